"""Exhaustive search: score every continuation and return the exact best one(s).

Beam search is a heuristic; for a tiny vocabulary ``V`` and few new tokens ``N`` the true
argmax of ``log p(y | x) / len(y) ** length_penalty`` over all ``V^N`` continuations can simply be
enumerated, level by level: every live prefix is extended by every token, a continuation that
emits eos (or a stop string) is complete and stops growing. That gives a ground truth to measure
beam search against. It refuses up front, naming the numbers, when ``V^N`` exceeds
``config.max_exhaustive_candidates``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.decoding.config import GenerationConfig
from llmlab.decoding.processors import build_processors
from llmlab.decoding.runner import ModelRunner
from llmlab.decoding.stopping import StopCondition


def check_exhaustive_size(vocab_size: int, config: GenerationConfig) -> None:
    count = vocab_size**config.max_new_tokens
    if count > config.max_exhaustive_candidates:
        raise ValueError(
            f"exhaustive search would score vocab_size**max_new_tokens = {vocab_size}**"
            f"{config.max_new_tokens} = {count:.3g} sequences, more than "
            f"max_exhaustive_candidates={config.max_exhaustive_candidates}; use num_beams > 1 "
            f"(beam search), fewer max_new_tokens, or raise max_exhaustive_candidates"
        )


def _search_one(
    model: Any, prompt: Tensor, config: GenerationConfig, stop: StopCondition
) -> list[tuple[float, list[int]]]:
    """All complete continuations of one unpadded prompt (1, P), best first: (score, tokens)."""
    P = prompt.shape[1]
    lp = config.length_penalty
    processors = build_processors(config, P, sampling=False)
    prefixes = prompt
    scores = torch.zeros(1)
    done: list[tuple[float, list[int]]] = []
    for depth in range(1, config.max_new_tokens + 1):
        runner = ModelRunner(model, prefixes.shape[0], prefixes.shape[1], use_cache=False)
        log_probs = F.log_softmax(runner.feed(prefixes)[:, -1], dim=-1)
        if processors:
            log_probs = processors(prefixes, log_probs)
        V = log_probs.shape[-1]
        if depth == 1:
            check_exhaustive_size(V, config)
        total = (scores[:, None] + log_probs).reshape(-1)
        grown = torch.cat(
            [prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(prefixes.shape[0])[:, None]],
            dim=1,
        )
        possible = torch.isfinite(total)
        grown, total = grown[possible], total[possible]
        ends = torch.ones_like(total, dtype=torch.bool)
        if depth < config.max_new_tokens:
            ends = stop(grown, P) if stop.active else torch.zeros_like(ends)
        norm = float(depth) ** lp
        for row in torch.nonzero(ends).flatten().tolist():
            done.append((float(total[row]) / norm, grown[row, P:].tolist()))
        prefixes, scores = grown[~ends], total[~ends]
        if prefixes.shape[0] == 0:
            break
    done.sort(key=lambda item: -item[0])
    return done


@torch.inference_mode()
def exhaustive_search(
    model: Any,
    input_ids: Tensor,
    config: GenerationConfig,
    attention_mask: Tensor | None = None,
    tokenizer: Any = None,
) -> Tensor:
    """The ``num_return_sequences`` best continuations of every prompt, padded HF-style."""
    B = input_ids.shape[0]
    stop = StopCondition(config.eos_token_ids, config.stop_string_list, tokenizer)
    pad = config.effective_pad_token_id
    rows: list[list[int]] = []
    for b in range(B):
        prompt = input_ids[b : b + 1]
        if attention_mask is not None:
            prompt = prompt[:, attention_mask[b].bool()]
        best = _search_one(model, prompt, config, stop)[: config.num_return_sequences]
        for _, tokens in best:
            rows.append(input_ids[b].tolist() + tokens)
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out.to(input_ids.device)
