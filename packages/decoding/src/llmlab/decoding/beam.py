"""Beam search, step for step the algorithm of HF ``generate`` (transformers 5.x), so tokens match.

Per prompt it keeps ``num_beams`` *running* hypotheses and the ``num_beams`` best *finished*
ones. Each step:

1. every running beam scores every token: ``running_score + log_softmax(logits)`` (then the
   processors), giving ``num_beams * V`` candidates per prompt;
2. the top ``K = max(2, 1 + n_eos) * num_beams`` candidates are kept (K > num_beams so that
   enough non-finished candidates remain when some end in eos);
3. candidates that hit a stop (eos, stop string, length limit) may enter the finished set, but
   only if they rank among the top ``num_beams`` candidates; their score is length-normalised:
   ``sum_logprob / generated_len ** length_penalty`` (the generated length, prompt excluded);
4. the best ``num_beams`` non-stopped candidates become the new running beams; the KV cache
   rows follow their parents (``reorder``).

Stopping (``early_stopping``): ``True`` stops a prompt once ``num_beams`` hypotheses are finished;
``False`` stops when the best running beam, normalised at its *current* length, cannot beat the
worst finished one (a heuristic); ``"never"`` uses the most optimistic length (``max_length``
when ``length_penalty > 0``), the exact test. Masked scores use HF's ``-1e9`` arithmetic on
purpose: ties among masked entries are then broken exactly as in HF.
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

MASKED = -1.0e9


def _gather(t: Tensor, idx: Tensor) -> Tensor:
    """Select along dim 1 (the beam dimension) with per-prompt indices (B, k)."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


@torch.inference_mode()
def beam_search(
    model: Any,
    input_ids: Tensor,
    config: GenerationConfig,
    attention_mask: Tensor | None = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Return (B * num_return_sequences, P + generated) ids, best hypotheses first per prompt."""
    B, P = input_ids.shape
    nb, lp, es = config.num_beams, config.length_penalty, config.early_stopping
    device = input_ids.device
    eos = config.eos_token_ids
    max_length = P + config.max_new_tokens
    keep = max(2, 1 + len(eos)) * nb
    top_nb = torch.arange(keep, device=device) < nb
    # HF's fill for unwritten positions: pad (or eos[0] when pad is 0/None), -1 without eos.
    if eos:
        pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
        fill = pad if pad != 0 else eos[0]
    else:
        fill = -1

    flat_ids = input_ids.repeat_interleave(nb, dim=0)
    mask = attention_mask.repeat_interleave(nb, dim=0) if attention_mask is not None else None
    processors = build_processors(config, P, mask)
    stop = StopCondition(eos, config.stop_string_list, tokenizer)
    runner = ModelRunner(model, B * nb, max_length, config.use_cache, mask)

    running = torch.full((B, nb, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :P] = flat_ids.view(B, nb, P)
    finished = running.clone()
    # only beam 0 starts alive, so the first step does not pick the same token nb times
    running_scores = torch.zeros(B, nb, device=device)
    running_scores[:, 1:] = MASKED
    finished_scores = torch.full((B, nb), MASKED, device=device)
    is_finished = torch.zeros(B, nb, dtype=torch.bool, device=device)
    finished_len = torch.zeros(B, nb, dtype=torch.long, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    batch_offset = torch.arange(B, device=device)[:, None] * nb

    cur = P
    logits = runner.feed(flat_ids)[:, -1]
    while True:
        log_probs = F.log_softmax(logits, dim=-1)
        if processors:
            log_probs = processors(running[:, :, :cur].reshape(B * nb, cur), log_probs)
        V = log_probs.shape[-1]
        acc = (log_probs.view(B, nb, V) + running_scores[:, :, None]).reshape(B, nb * V)

        # 1-2. the top-K continuations over all beams of a prompt
        if config.do_sample:
            idx = torch.multinomial(F.softmax(acc, dim=-1), keep, generator=generator)
            top_scores = acc.gather(1, idx)
            top_scores, order = top_scores.sort(dim=-1, descending=True)
            idx = idx.gather(1, order)
        else:
            top_scores, idx = acc.topk(keep)
        parent = idx // V
        cand = _gather(running, parent)
        cand[:, :, cur] = idx % V

        # 3. which candidates stop here
        hits = torch.zeros(B, keep, dtype=torch.bool, device=device)
        if cur + 1 >= max_length:
            hits[:] = True
        elif stop.active:
            flat = cand[:, :, : cur + 1].reshape(B * keep, cur + 1)
            hits = stop(flat, P).view(B, keep)

        # 4. next running beams: the best candidates that did not stop
        alive_scores = top_scores + hits.to(torch.float32) * MASKED
        pick = alive_scores.topk(nb)[1]
        running = _gather(cand, pick)
        running_scores = _gather(alive_scores, pick)
        running_parent = _gather(parent, pick)

        # finished set: merge the new finished candidates (top nb only) with the old ones
        just_finished = hits & top_nb[None, :]
        normed = top_scores / ((cur + 1 - P) ** lp)
        full = is_finished.all(dim=-1, keepdim=True) & (es is True)
        normed += full.to(torch.float32) * MASKED
        normed += (~improvable).to(torch.float32) * MASKED
        normed += (~just_finished) * MASKED
        merged_scores = torch.cat([finished_scores, normed], dim=1)
        best = merged_scores.topk(nb)[1]
        finished = _gather(torch.cat([finished, cand], dim=1), best)
        finished_scores = _gather(merged_scores, best)
        is_finished = _gather(torch.cat([is_finished, just_finished], dim=1), best)
        cand_len = torch.full((B, keep), cur + 1 - P, dtype=torch.long, device=device)
        finished_len = _gather(torch.cat([finished_len, cand_len], dim=1), best)

        runner.reorder((running_parent + batch_offset).view(-1))
        cur += 1

        # can a running beam still beat the worst finished one?
        if es == "never" and lp > 0.0:
            best_len = max_length - P
        else:
            best_len = cur - P
        best_possible = running_scores[:, :1] / (best_len**lp)
        worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0], MASKED)
        improvable = improvable & (best_possible > worst).any(dim=-1, keepdim=True)
        open_beams = not (bool(is_finished.all()) and es is True)
        if not (bool(improvable.any()) and open_beams and not bool(hits.all())):
            break
        logits = runner.feed(running[:, :, cur - 1].reshape(B * nb, 1))[:, -1]

    nrs = config.num_return_sequences
    out = finished[:, :nrs].reshape(B * nrs, max_length)
    out_len = P + int(finished_len[:, :nrs].max())
    return out[:, :out_len]
