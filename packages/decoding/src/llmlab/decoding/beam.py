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


class BeamSearch:
    """The state of one beam search over ``B`` prompts, advanced one step at a time.

    Whoever runs the model owns the loop: it feeds the ``B * num_beams`` rows, hands their
    next-token logits to :meth:`step`, moves each row's keys and values to follow
    ``step``'s answer (the parent row of every new beam), and feeds :meth:`last_tokens` next,
    until :attr:`done`. :func:`beam_search` runs it over a contiguous cache (``reorder``);
    ``llmlab.serving`` runs it over a paged one, where following a parent is a copy-on-write
    fork of its KV blocks. The prompts must be fed as ``input_ids.repeat_interleave(num_beams)``
    (every beam of a prompt starts from the same prompt).
    """

    def __init__(
        self,
        input_ids: Tensor,
        config: GenerationConfig,
        attention_mask: Tensor | None = None,
        tokenizer: Any = None,
        generator: torch.Generator | None = None,
    ) -> None:
        B, P = input_ids.shape
        nb = config.num_beams
        device = input_ids.device
        self.config, self.generator, self.B, self.P = config, generator, B, P
        eos = config.eos_token_ids
        self.max_length = P + config.max_new_tokens
        self.keep = max(2, 1 + len(eos)) * nb
        self.top_nb = torch.arange(self.keep, device=device) < nb
        # HF's fill for unwritten positions: pad (or eos[0] when pad is 0/None), -1 without eos.
        if eos:
            pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
            fill = pad if pad != 0 else eos[0]
        else:
            fill = -1
        mask = attention_mask.repeat_interleave(nb, dim=0) if attention_mask is not None else None
        self.processors = build_processors(config, P, mask)
        self.stop = StopCondition(eos, config.stop_string_list, tokenizer)
        self.running = torch.full((B, nb, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, :P] = input_ids[:, None]
        self.finished = self.running.clone()
        # only beam 0 starts alive, so the first step does not pick the same token nb times
        self.running_scores = torch.zeros(B, nb, device=device)
        self.running_scores[:, 1:] = MASKED
        self.finished_scores = torch.full((B, nb), MASKED, device=device)
        self.is_finished = torch.zeros(B, nb, dtype=torch.bool, device=device)
        self.finished_len = torch.zeros(B, nb, dtype=torch.long, device=device)
        self.improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
        self.batch_offset = torch.arange(B, device=device)[:, None] * nb
        self.cur = P
        self.done = False

    def step(self, logits: Tensor) -> Tensor:
        """Advance with the next-token ``logits`` (B * num_beams, V) of the running beams;
        returns, for each new running beam (row), the row of its parent."""
        if self.done:
            raise RuntimeError("BeamSearch.step: the search is already done")
        B, P, cur, config = self.B, self.P, self.cur, self.config
        nb, lp, es, keep = config.num_beams, config.length_penalty, config.early_stopping, self.keep
        device = logits.device
        log_probs = F.log_softmax(logits, dim=-1)
        if self.processors:
            log_probs = self.processors(self.running[:, :, :cur].reshape(B * nb, cur), log_probs)
        V = log_probs.shape[-1]
        acc = (log_probs.view(B, nb, V) + self.running_scores[:, :, None]).reshape(B, nb * V)

        # 1-2. the top-K continuations over all beams of a prompt
        if config.do_sample:
            idx = torch.multinomial(F.softmax(acc, dim=-1), keep, generator=self.generator)
            top_scores = acc.gather(1, idx)
            top_scores, order = top_scores.sort(dim=-1, descending=True)
            idx = idx.gather(1, order)
        else:
            top_scores, idx = acc.topk(keep)
        parent = idx // V
        cand = _gather(self.running, parent)
        cand[:, :, cur] = idx % V

        # 3. which candidates stop here
        hits = torch.zeros(B, keep, dtype=torch.bool, device=device)
        if cur + 1 >= self.max_length:
            hits[:] = True
        elif self.stop.active:
            flat = cand[:, :, : cur + 1].reshape(B * keep, cur + 1)
            hits = self.stop(flat, P).view(B, keep)

        # 4. next running beams: the best candidates that did not stop
        alive_scores = top_scores + hits.to(torch.float32) * MASKED
        pick = alive_scores.topk(nb)[1]
        self.running = _gather(cand, pick)
        self.running_scores = _gather(alive_scores, pick)
        running_parent = _gather(parent, pick)

        # finished set: merge the new finished candidates (top nb only) with the old ones
        just_finished = hits & self.top_nb[None, :]
        normed = top_scores / ((cur + 1 - P) ** lp)
        full = self.is_finished.all(dim=-1, keepdim=True) & (es is True)
        normed += full.to(torch.float32) * MASKED
        normed += (~self.improvable).to(torch.float32) * MASKED
        normed += (~just_finished) * MASKED
        merged_scores = torch.cat([self.finished_scores, normed], dim=1)
        best = merged_scores.topk(nb)[1]
        self.finished = _gather(torch.cat([self.finished, cand], dim=1), best)
        self.finished_scores = _gather(merged_scores, best)
        self.is_finished = _gather(torch.cat([self.is_finished, just_finished], dim=1), best)
        cand_len = torch.full((B, keep), cur + 1 - P, dtype=torch.long, device=device)
        self.finished_len = _gather(torch.cat([self.finished_len, cand_len], dim=1), best)
        self.cur = cur = cur + 1

        # can a running beam still beat the worst finished one?
        if es == "never" and lp > 0.0:
            best_len = self.max_length - P
        else:
            best_len = cur - P
        best_possible = self.running_scores[:, :1] / (best_len**lp)
        worst = torch.where(
            self.is_finished, self.finished_scores.min(dim=1, keepdim=True)[0], MASKED
        )
        self.improvable = self.improvable & (best_possible > worst).any(dim=-1, keepdim=True)
        open_beams = not (bool(self.is_finished.all()) and es is True)
        self.done = not (bool(self.improvable.any()) and open_beams and not bool(hits.all()))
        return (running_parent + self.batch_offset).view(-1)

    def last_tokens(self) -> Tensor:
        """(B * num_beams, 1): the token each running beam feeds next."""
        return self.running[:, :, self.cur - 1].reshape(-1, 1)

    def hypotheses(self) -> list[list[list[int]]]:
        """Per prompt, its ``num_return_sequences`` best finished hypotheses (generated tokens
        only, each cut at its own length), best first."""
        nrs = self.config.num_return_sequences
        lengths = self.finished_len[:, :nrs].tolist()
        rows = self.finished[:, :nrs, self.P :].tolist()
        return [[r[:n] for r, n in zip(rs, ns)] for rs, ns in zip(rows, lengths)]

    def result(self) -> Tensor:
        """(B * num_return_sequences, P + generated) ids, best hypotheses first per prompt
        (shorter ones padded with the fill token, as HF pads them)."""
        nrs = self.config.num_return_sequences
        out = self.finished[:, :nrs].reshape(self.B * nrs, self.max_length)
        return out[:, : self.P + int(self.finished_len[:, :nrs].max())]


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
    B = input_ids.shape[0]
    nb = config.num_beams
    search = BeamSearch(input_ids, config, attention_mask, tokenizer, generator)
    mask = attention_mask.repeat_interleave(nb, dim=0) if attention_mask is not None else None
    runner = ModelRunner(model, B * nb, search.max_length, config.use_cache, mask)
    logits = runner.feed(input_ids.repeat_interleave(nb, dim=0))[:, -1]
    while True:
        runner.reorder(search.step(logits))
        if search.done:
            return search.result()
        logits = runner.feed(search.last_tokens())[:, -1]
