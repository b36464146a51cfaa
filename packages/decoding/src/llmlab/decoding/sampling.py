"""Greedy decoding and sampling: one token per row per step, through the processors.

Each step: logits of the last position -> processors (penalties, then warpers when sampling) ->
``argmax`` (greedy) or a draw from ``softmax`` (sampling). Rows stop independently (eos, stop
string); a finished row keeps receiving ``pad_token_id`` until every row is done, which is how
HF lays out its output. The draw uses ``torch.multinomial(probs, 1)`` exactly as HF does, so with
the same RNG state both produce the same samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.decoding.config import GenerationConfig
from llmlab.decoding.processors import build_processors
from llmlab.decoding.runner import ModelRunner
from llmlab.decoding.stopping import StopCondition


@torch.inference_mode()
def decode_one_by_one(
    model: Any,
    input_ids: Tensor,
    config: GenerationConfig,
    attention_mask: Tensor | None = None,
    streamer: Any = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    sample: bool | None = None,
    compile: bool = False,
) -> Tensor:
    """Greedy (``sample=False``) or ancestral sampling (``sample=True``) for every row.

    ``compile``: one-token steps through the model's forward compiled over a static-shape cache
    (see ``llmlab.decoding.runner``); ``config.sliding_window`` lets generation run past the
    model's context.
    """
    sample = config.do_sample if sample is None else sample
    N, P = input_ids.shape
    pad = config.effective_pad_token_id
    processors = build_processors(config, P, attention_mask, sampling=sample)
    stop = StopCondition(config.eos_token_ids, config.stop_string_list, tokenizer)
    runner = ModelRunner(
        model,
        N,
        P + config.max_new_tokens,
        config.use_cache,
        attention_mask,
        window=config.sliding_window,
        stride=config.window_stride,
        compile=compile,
    )

    out = torch.empty(N, P + config.max_new_tokens, dtype=torch.long, device=input_ids.device)
    out[:, :P] = input_ids
    unfinished = torch.ones(N, dtype=torch.bool, device=input_ids.device)
    logits = runner.feed(input_ids)[:, -1]
    length = P
    while True:
        seq = out[:, :length]
        scores = processors(seq, logits) if processors else logits
        if sample:
            probs = torch.softmax(scores, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            next_ids = scores.argmax(dim=-1)
        next_ids = torch.where(unfinished, next_ids, pad)
        out[:, length] = next_ids
        length += 1
        if streamer is not None:
            streamer.put(next_ids.cpu())
        if stop.active:
            unfinished &= ~stop(out[:, :length], P)
            if not bool(unfinished.any()):
                break
        if length == P + config.max_new_tokens:
            break
        logits = runner.feed(next_ids[:, None])[:, -1]
    return out[:, :length]
