"""``LLMEngine``: requests in, tokens out, one scheduler step at a time.

``step()`` is the whole engine:

1. the scheduler picks this step's chunks (and preempts if blocks run out);
2. the model runner computes them in one forward over the paged KV pool;
3. every sequence whose chunk reached its end gets its next token (a request that was still
   one sequence forks into its ``num_return_sequences`` here, sharing the prompt's blocks); a
   beam-search request steps its search once all its beams have logits, re-forking the beams
   from their parents (``llmlab.serving.beam``) and reporting only its final hypotheses;
4. sequences that hit eos, a stop string or their length are retired at once -- their blocks
   are free for the very next step -- and each request that changed reports its new tokens
   and text.

Log-probabilities (``RequestOptions``) come from the same step's logits (``llmlab.serving.
logprobs``): a generated token's from the row it was chosen from, a prompt token's from the
rows prefill keeps for requests that ask (every position of their prompt chunks). A request
with ``prompt_only`` ends when its prompt is computed, with no token generated.

Structured output (``RequestOptions.grammar``, ``llmlab.serving.structured``): each sequence
of such a request carries an llguidance matcher. The masks of this step's grammar sequences are
computed once the forward is called and before its logits are read (they depend only on
accepted tokens; an accelerator runs the forward meanwhile), applied to their rows before any
token is chosen, and the chosen token advances the matcher; a sequence whose grammar is
complete finishes with ``"stop"``. A grammar that errs (or an injected
``grammar`` fault) ends its request alone.

Speculative decoding (``EngineConfig.speculative``, ``llmlab.serving.speculation``): before
the scheduler runs, each decoding sequence books slots for drafts; the granted ones are filled
by the proposer (n-gram lookup, or a draft model over its own KV pool) and computed with the
sequence's pending token in the same forward; after it, the drafts leave the sequences and
``Speculator.accept`` appends what ``llmlab.serving.verification`` keeps (greedy: the plain
tokens; sampled: rejection sampling, the target's distribution), one token at a time up to a
stop, counting only kept tokens as computed.

Isolation: a request is the unit of failure. Ids the tokenizer cannot decode (an embedding
padded past the vocabulary) are masked before any token is chosen, as HF's ``suppress_tokens``
does. If choosing a request's token (its logits processors, its sampling, its beam step) or
rendering its text raises, that request alone ends with ``RequestOutput.error`` set and its
blocks freed; if the batched forward raises, the requests of that step end so, and the engine
serves the next step. ``llmlab.serving.faults`` injects such faults for the tests.

The engine is synchronous and single-threaded; the offline ``LLM`` loops over ``step()`` and
the HTTP server runs it in a background thread (``llmlab.serving.async_engine``).

Its parts: ``request_checks`` (what a request must pass to be queued), ``step_grammar`` and
``step_logprobs`` (a step's masks and log-probabilities) and ``request_outputs`` (what a step
reports, its text detokenized).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from llmlab.decoding import GenerationConfig
from llmlab.models.moe import MoE
from llmlab.models.quantize import quantize
from llmlab.serving.adapters import AdapterSource, ServedAdapters
from llmlab.serving.beam import BeamGroup
from llmlab.serving.config import EngineConfig
from llmlab.serving.faults import FaultInjection, fire
from llmlab.serving.metrics import EngineStats
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.request_checks import SUPPORTED_STRATEGIES, check_request_values
from llmlab.serving.request_outputs import (
    RequestOutput,
    SequenceOutput,
    TrackedRequest,
    report,
    request_metrics,
)
from llmlab.serving.sampler import Failure, Rules, next_tokens, stop_reason
from llmlab.serving.scheduler import Scheduler
from llmlab.serving.sequence import Request, RequestOptions, Sequence
from llmlab.serving.speculation import Speculator
from llmlab.serving.step_grammar import (
    advance_grammar,
    apply_masks,
    compute_masks,
    masked_sequences,
)
from llmlab.serving.step_logprobs import (
    record_prompt_logprobs,
    record_token_logprobs,
    wants_prompt_rows,
)
from llmlab.serving.structured import Grammars

__all__ = ["SUPPORTED_STRATEGIES", "LLMEngine", "RequestOutput", "SequenceOutput"]

log = logging.getLogger("llmlab.serving")


def check_compilable(model: Any, adapters: Any = None) -> None:
    """Refuse ``compile=True`` where a decode step cannot be one compiled graph (the target's
    or a draft model's: both runners compile)."""
    if adapters:
        raise ValueError(
            "EngineConfig: compile=True with LoRA adapters: each token's adapter is set "
            "around an eager forward; serve adapters with compile=False"
        )
    if any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError(
            f"EngineConfig: compile=True with {type(model).__name__}'s mixture-of-experts "
            "layers: their tokens per expert are data, which torch.compile cannot trace into "
            "one graph; serve MoE models with compile=False"
        )


class LLMEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        adapters: dict[str, AdapterSource] | None = None,  # LoRA: name -> peft folder or state
        draft_model: Any = None,  # speculative="draft": the model that proposes tokens
    ):
        self.config = (config or EngineConfig()).resolved(model.config.block_size)
        if (draft_model is not None) != (self.config.speculative == "draft"):
            raise ValueError(
                f"speculative={self.config.speculative!r} with "
                f"{'a' if draft_model is not None else 'no'} draft_model: a draft model is "
                f"given exactly when speculative='draft'"
            )
        if self.config.compile:
            check_compilable(model, adapters)
            if draft_model is not None:
                check_compilable(draft_model)
        if self.config.quantize is not None:  # in place: the full-precision weights are freed
            quantize(model, self.config.quantize)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapters = ServedAdapters(model, adapters)  # on the (quantized) base layers
        self.runner = ModelRunner(model, self.config, self.adapters)
        self.scheduler = Scheduler(self.config)
        self.stats = EngineStats(num_blocks=self.config.num_blocks)
        self.suppressed = undecodable_ids(tokenizer, model.config.vocab_size, self.runner.device)
        self.faults = FaultInjection.from_config(self.config.inject_fault)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.suppressed)
        self.speculator = None
        if self.config.speculative is not None:
            self.speculator = Speculator(self.config, model, draft_model, self.suppressed)
            self.stats.speculator = self.speculator
        self._tracked: dict[str, TrackedRequest] = {}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        options: RequestOptions | None = None,
    ) -> Request:
        """Queue a request; every bad value is refused here, before any work starts."""
        config = config or GenerationConfig()
        options = options or RequestOptions()
        self.check_request(request_id, prompt_ids, config, options)
        request = Request(
            request_id, list(prompt_ids), config, next(self._arrivals), options=options
        )
        rules = Rules.of(config, len(prompt_ids), self.tokenizer)
        if self.faults is not None:
            rules.fault = self.faults.stage_for(prompt_ids, self.tokenizer)
        if config.resolved_strategy() == "beam":
            request.beam = BeamGroup(request, self.tokenizer, self.runner.device)
        first = request.new_sequence(0, request.prompt_ids, self.runner.device)
        if options.grammar is not None:
            first.grammar = self.grammars.matcher(options.grammar, list(config.eos_token_ids))
        self._tracked[request_id] = TrackedRequest(request, rules)
        self.scheduler.add(request.sequences[0])
        return request

    def check_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        config: GenerationConfig,
        options: RequestOptions | None = None,
    ) -> None:
        """Raise ``ValueError`` naming what is wrong with a request (the server's 400s)."""
        options = options or RequestOptions()
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model.config.vocab_size
        check_request_values(
            self.config, vocab, self.tokenizer, self.grammars, prompt_ids, config, options,
            self.adapters.names,
        )  # fmt: skip

    def abort(self, request_id: str) -> None:
        """Cancel a request: its sequences stop and their blocks return to the pool now."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        request = tracked.request
        request.forked = True
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if request.beam is not None:
            request.beam.pending.clear()
        self.stats.finished(request, "abort")
        self.stats.observe_queues(self.scheduler)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    # ----------------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running, self._tracked)
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        drafted = self.speculator.propose(out, self._tracked) if self.speculator else {}
        every_row = {i for i, c in enumerate(out.chunks) if wants_prompt_rows(c)}
        every_row |= {d.chunk for d in drafted.values()}  # drafts are checked at every row
        masked, grammar_errors = masked_sequences(out.chunks, self._tracked)
        try:
            for chunk in out.chunks:
                fire("forward", self._tracked[chunk.seq.request.request_id].rules.fault)
            logits = self.runner.execute(out.chunks, out.copies, every_row)
        except Exception as err:
            Speculator.take_back(drafted)
            ids = dict.fromkeys(c.seq.request.request_id for c in out.chunks)
            failed = [self._fail(rid, "forward", err) for rid in ids]
            self.stats.observe_queues(self.scheduler)
            return [f for f in failed if f is not None]
        Speculator.take_back(drafted)
        self.scheduler.after_forward(out)
        failed: dict[str, RequestOutput | None] = {}
        # the grammar masks, before the logits are read: an accelerator runs the forward meanwhile
        refused = compute_masks(masked, grammar_errors, self.grammars, failed, self._fail)
        draft_rows = Speculator.rows(out.chunks, every_row, logits, drafted) if drafted else {}
        if every_row:  # prompt log-probabilities; then one row per completing chunk
            logits = record_prompt_logprobs(
                out.chunks, every_row, logits, failed, self._tracked, self._fail
            )
        raw = logits  # the model's logits: what log-probabilities are reported of
        if self.suppressed is not None:  # ids the tokenizer cannot decode are never chosen
            logits = logits.index_fill(1, self.suppressed, float("-inf"))
        seqs: list[Sequence] = []
        rows: list[int] = []
        grammar_rows: list[int | None] = []  # each sequence's row of `refused`, if it has one
        changed: dict[str, TrackedRequest] = {}
        other_tokens = 0  # a beam step's, and verified drafts' (with their fix or bonus)
        for row, chunk in enumerate(c for c in out.chunks if c.completes):
            request = chunk.seq.request
            rid = request.request_id
            if rid in failed:
                continue
            if request.beam is not None:  # the search steps once every beam has its logits
                other_tokens += 1
                fault, stage = self._tracked[rid].rules.fault, "logits"
                try:
                    fire("logits", fault)
                    stage = "sampling"  # the search's step: its scores and its choice
                    fire("sampling", fault)
                    done = request.beam.add(chunk.seq, logits[row], self.scheduler)
                except Exception as err:
                    failed[rid] = self._fail(rid, stage, err)
                    changed.pop(rid, None)
                    continue
                if done:
                    self._first_token(request, time.perf_counter())
                    changed[rid] = self._tracked[rid]
                continue
            if request.options.prompt_only:  # the prompt is computed: done, nothing generated
                for seq in self._fork(chunk.seq):
                    self.scheduler.finish(seq, "length")
                changed[rid] = self._tracked[rid]
                continue
            family = self._fork(chunk.seq)
            seqs += family
            rows += [row] * len(family)
            grammar_rows += [masked.get(chunk.seq)] * len(family)  # forks share their first mask
        if drafted:  # verified: the kept drafts and the target's own token join the sequences
            for seq in self.speculator.accept(
                drafted, draft_rows, self._tracked, self.scheduler, failed, self._fail
            ):
                other_tokens += seq.num_tokens - drafted[seq].base
                if seq.request.request_id not in failed:
                    changed[seq.request.request_id] = self._tracked[seq.request.request_id]
            keep = [i for i, seq in enumerate(seqs) if seq not in drafted]
            seqs, rows = [seqs[i] for i in keep], [rows[i] for i in keep]
            grammar_rows = [grammar_rows[i] for i in keep]
        rules = [self._tracked[s.request.request_id].rules for s in seqs]
        if rows != list(range(logits.shape[0])):  # forks and beams: a gather (a copy)
            logits = logits[rows]
        if refused is not None:
            logits = apply_masks(logits, refused, grammar_rows)
        tokens = next_tokens(seqs, rules, logits)
        for seq, token in zip(seqs, tokens):  # a failed choice fails its request first
            rid = seq.request.request_id
            if isinstance(token, Failure) and rid not in failed:
                failed[rid] = self._fail(rid, token.stage, token.error)
        record_token_logprobs(seqs, rows, tokens, raw, failed, self._tracked, self._fail)
        now = time.perf_counter()
        generated = 0
        for seq, token in zip(seqs, tokens):
            rid = seq.request.request_id
            if rid in failed:
                continue
            tracked = self._tracked[rid]
            complete = False
            if seq.grammar is not None and token not in tracked.rules.eos:
                try:
                    complete = advance_grammar(seq.grammar, token)
                except Exception as err:
                    failed[rid] = self._fail(rid, "grammar", err)
                    changed.pop(rid, None)
                    continue
            seq.token_ids.append(token)
            generated += 1
            self._first_token(seq.request, now)
            reason = stop_reason(seq, tracked.rules, self.config.max_model_len)
            if reason is None and complete:  # the grammar takes no more: the text is whole
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, reason)
            changed[rid] = tracked
        self.stats.step(out, generated + other_tokens, self.scheduler)
        outputs = []
        for rid, tracked in changed.items():
            try:
                outputs.append(report(tracked, self.tokenizer))
            except Exception as err:
                failed[rid] = self._fail(rid, "detokenize", err)
        for output in outputs:
            if output.finished:
                finished = self._tracked.pop(output.request_id)
                self.stats.finished(finished.request, None)
        if failed:
            self.stats.observe_queues(self.scheduler)
        return outputs + [f for f in failed.values() if f is not None]

    def _fail(self, request_id: str, stage: str, err: BaseException) -> RequestOutput | None:
        """End ``request_id`` with an error: its sequences stop, their blocks return to the
        pool, the error is logged with the request's id and counted by stage."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        request = tracked.request
        request.forked = True
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        if request.beam is not None:
            request.beam.pending.clear()
        self.stats.finished(request, "error")
        self.stats.error(stage)
        log.error("request %s failed at the %s stage: %r", request_id, stage, err)
        outputs = [
            SequenceOutput(seq.index, list(seq.output_ids), "", [], "", "error")
            for seq in request.sequences
        ]
        return RequestOutput(
            request_id,
            request.prompt_ids,
            outputs,
            True,
            request_metrics(request),
            error=f"{stage}: {err}",
        )

    def fail_all(self, err: BaseException) -> list[RequestOutput]:
        """End every request with ``err`` (the last resort when a step itself raised)."""
        failed = [self._fail(rid, "engine", err) for rid in list(self._tracked)]
        self.stats.observe_queues(self.scheduler)
        return [f for f in failed if f is not None]

    def _first_token(self, request: Request, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            self.stats.first_token(now - request.arrival_time)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """``seq`` and, at a request's first token, its new siblings sharing its blocks."""
        request = seq.request
        if request.forked:
            return [seq]
        request.forked = True
        family = [seq]
        for index in range(1, request.config.num_return_sequences):
            child = request.new_sequence(index, seq.token_ids, self.runner.device)
            if seq.grammar is not None:  # the same state: its own copy from here on
                child.grammar = seq.grammar.deep_copy()
            self.scheduler.blocks.fork(seq, child)
            self.scheduler.add_running(child)
            family.append(child)
        return family


def undecodable_ids(tokenizer: Any, vocab_size: int, device: Any) -> Any:
    """The ids below the model's ``vocab_size`` that ``tokenizer`` cannot decode (an embedding
    padded past the tokenizer's vocabulary, as Qwen2's is), as a LongTensor; None if every id
    decodes or there is no tokenizer. One decode of every id first; one per id if that fails."""
    if tokenizer is None:
        return None
    decode = getattr(tokenizer, "decode_bytes", None) or tokenizer.decode

    def decodes(ids: list[int]) -> bool:
        try:
            decode(ids)
        except Exception:
            return False
        return True

    if decodes(list(range(vocab_size))):
        return None
    bad = [i for i in range(vocab_size) if not decodes([i])]
    if len(bad) == vocab_size:
        raise ValueError(f"the tokenizer decodes none of the model's {vocab_size} ids")
    return torch.tensor(bad, dtype=torch.long, device=device) if bad else None
