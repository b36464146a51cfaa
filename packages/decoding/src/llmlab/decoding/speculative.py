"""Speculative decoding: a small draft model proposes ``k`` tokens, the target checks them at once.

The target scores all ``k`` proposals (plus one more position) in a single forward pass, so
when the draft guesses well several tokens cost one target step. Correctness does not depend on
the draft:

* **greedy**: proposal ``d_i`` is accepted while it equals the target's own argmax; the first
  disagreement is replaced by the target's argmax. The output is plain greedy's, token for token.
* **sampling** (Leviathan et al. 2023, Chen et al. 2023): accept ``d_i ~ q`` with probability
  ``min(1, p(d_i) / q(d_i))``; on rejection draw from ``norm(max(0, p - q))``; after ``k``
  acceptances draw a bonus token from ``p``. Every emitted token is then distributed exactly as
  ``p``, the target's (processed) next-token distribution.

Processors (penalties, temperature, top-k/p, min-p) are applied to both models at every
position with the right prefix, so ``p`` and ``q`` are the distributions plain decoding would
sample. Rows of a batch would accept different numbers of tokens, so this works on one
sequence at a time (prompts are processed one after another).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llmlab.decoding.config import GenerationConfig
from llmlab.decoding.processors import ProcessorList, build_processors
from llmlab.decoding.runner import ModelRunner
from llmlab.decoding.stopping import StopCondition


@dataclass
class SpeculativeStats:
    """Draft tokens proposed and accepted, and target forward passes, summed over a call."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0
    new_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _process(processors: ProcessorList, seq: Tensor, logits: Tensor) -> Tensor:
    return processors(seq, logits) if processors else logits


def _speculate_one(
    target: Any,
    draft: Any,
    prompt: Tensor,
    config: GenerationConfig,
    stop: StopCondition,
    stats: SpeculativeStats,
    generator: torch.Generator | None,
    streamer: Any,
) -> list[int]:
    """Decode one unpadded prompt (1, P); return the new tokens."""
    sample = config.do_sample
    P = prompt.shape[1]
    max_len = P + config.max_new_tokens
    processors = build_processors(config, P, sampling=sample)
    t_run = ModelRunner(target, 1, max_len, config.use_cache)
    d_run = ModelRunner(draft, 1, max_len, config.use_cache)
    seq = prompt
    while seq.shape[1] < max_len:
        remaining = max_len - seq.shape[1]
        k = min(config.num_assistant_tokens, remaining - 1)
        # -- the draft proposes k tokens (catching up on any tokens it has not seen first)
        drafts: list[int] = []
        q_dists: list[Tensor] = []
        ctx = seq
        for _ in range(k):
            logits = d_run.feed(ctx[:, d_run.length :])[:, -1]
            scores = _process(processors, ctx, logits)
            if sample:
                q = torch.softmax(scores, dim=-1)
                tok = int(torch.multinomial(q, 1, generator=generator))
                q_dists.append(q[0])
            else:
                tok = int(scores.argmax(dim=-1))
            drafts.append(tok)
            ctx = torch.cat([ctx, ctx.new_tensor([[tok]])], dim=1)
        # -- the target scores every proposal in one pass: k + 1 next-token distributions
        t_logits = t_run.feed(ctx[:, t_run.length :], keep=k + 1)[0]
        stats.target_calls += 1
        stats.proposed += k
        new: list[int] = []
        for i in range(k + 1):
            prefix = ctx[:, : seq.shape[1] + i]
            scores = _process(processors, prefix, t_logits[i : i + 1])[0]
            if not sample:
                best = int(scores.argmax())
                new.append(best)
                if i < k and best == drafts[i]:
                    continue
                break
            p = torch.softmax(scores, dim=-1)
            if i == k:  # every proposal accepted: a bonus token from the target
                new.append(int(torch.multinomial(p, 1, generator=generator)))
                break
            d, q = drafts[i], q_dists[i]
            u = float(torch.rand((), generator=generator))
            if u < min(1.0, float(p[d] / q[d])):
                new.append(d)
                continue
            residual = (p - q).clamp(min=0)
            if float(residual.sum()) <= 0:  # p == q: cannot happen after a rejection, but be safe
                residual = p
            new.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
            break
        stats.accepted += len(new) - 1  # the last token is the target's own (fix or bonus)
        # -- append the accepted tokens one by one, so a stop inside them ends the sequence there
        stopped = False
        emitted: list[int] = []
        for tok in new:
            seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
            emitted.append(tok)
            if stop.active and bool(stop(seq, P)[0]):
                stopped = True
                break
        if streamer is not None:
            streamer.put(torch.tensor(emitted))
        if stopped:
            break
        # -- forget cached positions past the accepted prefix (the last token is not cached yet)
        t_run.crop(min(t_run.length, seq.shape[1] - 1))
        d_run.crop(min(d_run.length, seq.shape[1] - 1))
    stats.new_tokens += seq.shape[1] - P
    return seq[0, P:].tolist()


@torch.inference_mode()
def speculative_generate(
    target: Any,
    draft: Any,
    input_ids: Tensor,
    config: GenerationConfig,
    attention_mask: Tensor | None = None,
    tokenizer: Any = None,
    streamer: Any = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, SpeculativeStats]:
    """Speculative decoding of every row; returns HF-laid-out ids and acceptance statistics."""
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"streaming needs a single prompt, got batch size {input_ids.shape[0]}")
    stop = StopCondition(config.eos_token_ids, config.stop_string_list, tokenizer)
    stats = SpeculativeStats()
    rows = []
    for b in range(input_ids.shape[0]):
        prompt = input_ids[b : b + 1]
        if attention_mask is not None:
            prompt = prompt[:, attention_mask[b].bool()]
        rows.append(
            input_ids[b].tolist()
            + _speculate_one(target, draft, prompt, config, stop, stats, generator, streamer)
        )
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), config.effective_pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out.to(input_ids.device), stats
