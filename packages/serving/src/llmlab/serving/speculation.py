"""Speculative decoding in the engine: k drafts per sequence, checked in one target forward.

A decoding sequence normally computes one token per step. With ``EngineConfig.speculative``,
a sequence that is decoding proposes up to ``num_speculative_tokens`` draft tokens, and the
step computes them with its pending token as one chunk of ``1 + k`` tokens over the paged KV
pool: the target's logits at all ``k + 1`` positions come from that one forward, so every
accepted draft is a token that cost no forward of its own. Which drafts are kept is decided by
``llmlab.serving.verification`` (greedy: while they equal the target's choice; sampled:
rejection sampling, so the output is distributed exactly as the target's); the output never
depends on the drafts, only the speed does.

Two proposers:

* **n-gram** (prompt lookup, ``speculative="ngram"``): the sequence's last ``n`` tokens
  (``ngram_max`` down to ``ngram_min``) are looked up in its earlier tokens; the ``k`` tokens
  that followed their latest occurrence are the drafts. Free to compute, and right whenever the
  output copies its input (code edits, quoting, extraction, repetitive text).
* **a draft model** (``speculative="draft"``, ``LLMEngine(draft_model=...)``): a smaller model,
  or the same one with fewer bytes per weight (``draft_quantize``), proposes ``k`` tokens
  autoregressively. It has its own KV pool, laid out by the target's block tables (a sequence's
  blocks hold both models' keys at the same slots), and follows the target: every prompt chunk
  the target computes, the draft computes in the same step, so at decode time it only catches
  up on the one or two tokens the last verification added. Its distribution ``q`` is computed
  with the request's own processors, so ``p / q`` compares like with like.

The step's life of a draft: :meth:`Speculator.plan` books ``lookahead`` slots for each
decoding sequence before the scheduler runs (the scheduler grants them where the step's token
budget and the pool allow); :meth:`Speculator.propose` appends the drafts to the sequences and
their chunks; after the forward :meth:`Speculator.take_back` removes them again (the pool keeps
their keys and values, which the accepted ones need) and :meth:`Speculator.accept` appends what
verification kept, counts the accepted drafts as computed and hashes the blocks they filled.
Rejected drafts' slots are simply overwritten later: nothing past ``num_computed`` is trusted.

Who speculates: sequences of sampling and greedy requests (penalties, stop strings and
log-probabilities included) once they decode. Beam search (its beams fork every step) and
structured output (the grammar would have to be advanced over drafts and rolled back) decode
one token per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llmlab.models.quantize import quantize
from llmlab.serving.config import EngineConfig
from llmlab.serving.faults import fire
from llmlab.serving.logprobs import token_logprobs
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.request_outputs import TrackedRequest
from llmlab.serving.sampler import Failure, Rules, stop_reason
from llmlab.serving.scheduler import Chunk, Scheduler, SchedulerOutput
from llmlab.serving.sequence import Request, Sequence
from llmlab.serving.verification import verify

log = logging.getLogger("llmlab.serving")


@dataclass
class Drafted:
    """One sequence's drafts in this step: the ``tokens`` after its first ``base`` tokens, the
    draft's distributions ``probs`` (k, V) they were sampled from (None: point masses, as an
    n-gram's or a greedy draft's are), and the ``chunk`` of the step that verifies them."""

    chunk: int
    base: int
    tokens: list[int]
    probs: Tensor | None


def ngram_drafts(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the (up to) ``k`` tokens that followed the latest earlier occurrence of
    the longest suffix n-gram of ``tokens`` (``n_max`` down to ``n_min``); [] if none recurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def may_speculate(request: Request) -> bool:
    """Whether ``request``'s sequences can verify drafts (not beam search, no grammar)."""
    return request.beam is None and request.options.grammar is None


class DraftModel:
    """The draft proposer: a model with its own KV pool over the target's block tables."""

    def __init__(self, model: Any, config: EngineConfig, target: Any) -> None:
        if model is target:
            raise ValueError(
                "draft model: it is the target model itself; pass a copy (copy.deepcopy(model)) "
                "-- with draft_quantize it is converted in place, and as it is it saves nothing"
            )
        mine, theirs = model.config.vocab_size, target.config.vocab_size
        if mine != theirs:
            raise ValueError(
                f"draft model: vocab_size={mine} differs from the target's {theirs}; a draft "
                f"must share the target's tokenizer and vocabulary"
            )
        if model.config.block_size < config.max_model_len:
            raise ValueError(
                f"draft model: its context of {model.config.block_size} tokens is shorter than "
                f"max_model_len={config.max_model_len}; serve with a smaller max_model_len"
            )
        if config.draft_quantize is not None:
            quantize(model, config.draft_quantize)
        self.runner = ModelRunner(model.eval(), config)

    def propose(
        self,
        out: SchedulerOutput,
        wanted: dict[Sequence, int],
        rules: dict[Sequence, Rules],
        suppressed: Tensor | None,
    ) -> dict[Sequence, tuple[list[int], Tensor | None]]:
        """Follow the step's chunks (prompt chunks too) and draft ``wanted[seq]`` tokens for
        each decoding sequence; the drafts are appended to the sequences' tokens."""
        if out.copies:
            self.runner.pool.copy_blocks(out.copies)
        catch_up = []
        for chunk in out.chunks:
            seq = chunk.seq
            if not may_speculate(seq.request):
                continue
            begin = min(seq.draft_computed, chunk.start)
            catch_up.append(Chunk(seq, begin, chunk.start + chunk.num_tokens - begin))
        if not catch_up:
            return {}
        logits = self.runner.execute(catch_up)
        for chunk in catch_up:
            chunk.seq.draft_computed = chunk.start + chunk.num_tokens
        completing = [c.seq for c in catch_up if c.completes]
        rows = dict(zip(completing, logits))
        drafts: dict[Sequence, tuple[list[int], list[Tensor]]] = {s: ([], []) for s in wanted}
        active = [s for s in wanted if s in rows]
        while active:
            for seq in active:
                token, q = self._choose(seq, rules[seq], rows[seq], suppressed)
                if token is None:  # non-finite scores: this sequence drafts no further
                    wanted[seq] = 0
                    continue
                drafts[seq][0].append(token)
                if q is not None:
                    drafts[seq][1].append(q)
                seq.token_ids.append(token)
            active = [s for s in active if len(drafts[s][0]) < wanted[s]]
            if not active:
                break
            steps = [Chunk(s, s.num_tokens - 1, 1) for s in active]
            logits = self.runner.execute(steps)
            for seq, row in zip(active, logits):
                seq.draft_computed = seq.num_tokens - 1
                rows[seq] = row
        return {s: (t, torch.stack(q) if q else None) for s, (t, q) in drafts.items() if t}

    @staticmethod
    def _choose(
        seq: Sequence, r: Rules, logits: Tensor, suppressed: Tensor | None
    ) -> tuple[int | None, Tensor | None]:
        """The draft's token after ``seq``'s tokens, and the distribution it was drawn from."""
        scores = logits[None]
        if suppressed is not None:
            scores = scores.index_fill(1, suppressed, float("-inf"))
        try:
            if r.processors:
                context = torch.tensor([seq.token_ids], device=logits.device)
                scores = r.processors(context, scores)
        except Exception:  # the target's verification meets the same fault and reports it
            return None, None
        if not torch.isfinite(scores.max()):
            return None, None
        if not r.sample:
            return int(scores.argmax()), None
        q = torch.softmax(scores[0], dim=-1)
        return int(torch.multinomial(q, 1, generator=seq.generator)), q


class Speculator:
    """Drafts for a step's decoding sequences, and what becomes of them after the forward."""

    def __init__(
        self, config: EngineConfig, target: Any, draft_model: Any, suppressed: Tensor | None
    ) -> None:
        self.config = config
        self.suppressed = suppressed
        self.draft = DraftModel(draft_model, config, target) if draft_model is not None else None
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # of which the target kept
        self.drafted_steps = 0  # sequence-steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def plan(self, running: list[Sequence], tracked: dict[str, TrackedRequest]) -> None:
        """Book draft slots for each decoding sequence: as many as its length limits allow."""
        k, max_len = self.config.num_speculative_tokens, self.config.max_model_len
        for seq in running:
            request = seq.request
            seq.lookahead = 0
            if (
                request.forked
                and may_speculate(request)
                and seq.num_computed == seq.num_tokens - 1
                and request.request_id in tracked
            ):
                left = tracked[request.request_id].rules.max_new_tokens - len(seq.output_ids)
                seq.lookahead = max(0, min(k, left - 1, max_len - seq.num_tokens - 1))

    def propose(
        self, out: SchedulerOutput, tracked: dict[str, TrackedRequest]
    ) -> dict[Sequence, Drafted]:
        """Draft tokens for the chunks granted lookahead; they join the sequences and chunks."""
        wanted = {c.seq: c.lookahead for c in out.chunks if c.lookahead}
        index = {c.seq: i for i, c in enumerate(out.chunks)}
        bases = {seq: seq.num_tokens for seq in wanted}
        if self.draft is not None:
            rules = {c.seq: tracked[c.seq.request.request_id].rules for c in out.chunks}
            try:
                proposals = self.draft.propose(out, wanted, rules, self.suppressed)
            except Exception as err:  # no drafts this step: the target decodes as usual
                log.error("the draft model's forward failed: %r", err)
                for seq, base in bases.items():
                    del seq.token_ids[base:]
                return {}
        else:
            proposals = {}
            cfg = self.config
            for seq, k in wanted.items():
                tokens = ngram_drafts(seq.token_ids, k, cfg.ngram_min, cfg.ngram_max)
                if tokens:
                    seq.token_ids += tokens
                    proposals[seq] = (tokens, None)
        drafted = {}
        for seq, (tokens, probs) in proposals.items():
            chunk = out.chunks[index[seq]]
            chunk.num_tokens += len(tokens)
            chunk.drafts = len(tokens)
            drafted[seq] = Drafted(index[seq], bases[seq], tokens, probs)
        return drafted

    @staticmethod
    def take_back(drafted: dict[Sequence, Drafted]) -> None:
        """The drafts leave the sequences' tokens (their keys and values stay in the pool)."""
        for seq, d in drafted.items():
            del seq.token_ids[d.base :]

    @staticmethod
    def rows(
        chunks: list[Chunk], every_row: set[int], logits: Tensor, drafted: dict[Sequence, Drafted]
    ) -> dict[Sequence, Tensor]:
        """Each drafted sequence's ``k + 1`` rows of the step's logits (the runner keeps every
        row of the chunks in ``every_row``, the last of the other completing ones)."""
        wanted = {d.chunk: seq for seq, d in drafted.items()}
        out, r = {}, 0
        for i, chunk in enumerate(chunks):
            n = chunk.num_tokens if i in every_row else int(chunk.completes)
            if i in wanted:
                out[wanted[i]] = logits[r : r + n]
            r += n
        return out

    def accept(
        self,
        drafted: dict[Sequence, Drafted],
        rows: dict[Sequence, Tensor],
        tracked: dict[str, TrackedRequest],
        scheduler: Scheduler,
        failed: dict[str, Any],
        fail: Any,
    ) -> list[Sequence]:
        """Verify each sequence's drafts and append what the target keeps (up to a stop);
        returns the sequences that gained tokens (a failed one fails its request alone)."""
        grew = []
        for seq, d in drafted.items():
            rid = seq.request.request_id
            if rid in failed or rid not in tracked:
                continue
            rules = tracked[rid].rules
            raw = rows[seq]
            scores = (
                raw
                if self.suppressed is None
                else raw.index_fill(1, self.suppressed, float("-inf"))
            )
            result = verify(seq, rules, scores, d.tokens, d.probs)
            if isinstance(result, Failure):
                failed[rid] = fail(rid, result.stage, result.error)
                continue
            self.proposed += len(d.tokens)
            self.accepted += len(result) - 1  # the last is the target's own (a fix or a bonus)
            self.drafted_steps += 1
            reason = None
            kept = 0
            for token in result:
                seq.token_ids.append(token)
                kept += 1
                reason = stop_reason(seq, rules, self.config.max_model_len)
                if reason is not None:
                    break
            if seq.request.options.logprobs is not None:
                try:
                    fire("logprobs", rules.fault)
                    top = [seq.request.options.logprobs] * kept
                    seq.logprobs += token_logprobs(raw[:kept], result[:kept], top)
                except Exception as err:
                    failed[rid] = fail(rid, "logprobs", err)
                    continue
            grew.append(seq)
            if reason is not None:
                scheduler.finish(seq, reason)
                continue
            seq.num_computed = seq.num_tokens - 1  # the pending token and the kept drafts
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)
            scheduler.blocks.register_full_blocks(seq)
        return grew
