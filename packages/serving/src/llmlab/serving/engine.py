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
computed in a worker thread while the forward runs (they depend only on accepted tokens),
applied to their rows before any token is chosen, and the chosen token advances the matcher; a
sequence whose grammar is complete finishes with ``"stop"``. A grammar that errs (or an injected
``grammar`` fault) ends its request alone.

Isolation: a request is the unit of failure. Ids the tokenizer cannot decode (an embedding
padded past the vocabulary) are masked before any token is chosen, as HF's ``suppress_tokens``
does. If choosing a request's token (its logits processors, its sampling, its beam step) or
rendering its text raises, that request alone ends with ``RequestOutput.error`` set and its
blocks freed; if the batched forward raises, the requests of that step end so, and the engine
serves the next step. ``llmlab.serving.faults`` injects such faults for the tests.

The engine is synchronous and single-threaded; the offline ``LLM`` loops over ``step()`` and
the HTTP server runs it in a background thread (``llmlab.serving.async_engine``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmlab.decoding import GenerationConfig
from llmlab.models.quantize import quantize
from llmlab.serving.beam import BeamGroup
from llmlab.serving.config import EngineConfig
from llmlab.serving.detokenize import IncrementalText
from llmlab.serving.faults import FaultInjection, fire
from llmlab.serving.logprobs import token_logprobs
from llmlab.serving.metrics import EngineStats
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.sampler import Failure, Rules, next_tokens, stop_reason
from llmlab.serving.scheduler import Chunk, Scheduler
from llmlab.serving.sequence import (
    SEED_RANGE,
    Request,
    RequestOptions,
    Sequence,
    Status,
    TokenLogprob,
)
from llmlab.serving.structured import Grammars, MaskJob

log = logging.getLogger("llmlab.serving")
SUPPORTED_STRATEGIES = ("greedy", "sample", "beam")


@dataclass
class SequenceOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    text: str  # the text released so far (see llmlab.serving.detokenize)
    new_token_ids: list[int]  # since this sequence's previous output
    new_text: str
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    # the new tokens' log-probabilities (RequestOptions.logprobs), one per new token
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    outputs: list[SequenceOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the request failed (then finished): "<stage>: <exception>"
    # RequestOptions.prompt_logprobs: one per prompt token (None for the first), in the first
    # output after prefill computed them (None in the others)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class _Tracked:
    """The engine's per-request extras: decoding rules, texts, what was reported."""

    request: Request
    rules: Rules
    texts: dict[int, IncrementalText] = field(default_factory=dict)
    reported: dict[int, int] = field(default_factory=dict)  # tokens already reported
    prompt_reported: bool = False  # the prompt's log-probabilities (reported once)


class LLMEngine:
    def __init__(self, model: Any, tokenizer: Any = None, config: EngineConfig | None = None):
        self.config = (config or EngineConfig()).resolved(model.config.block_size)
        if self.config.quantize is not None:  # in place: the full-precision weights are freed
            quantize(model, self.config.quantize)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, self.config)
        self.scheduler = Scheduler(self.config)
        self.stats = EngineStats(num_blocks=self.config.num_blocks)
        self.suppressed = undecodable_ids(tokenizer, model.config.vocab_size, self.runner.device)
        self.faults = FaultInjection.from_config(self.config.inject_fault)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.suppressed)
        self._tracked: dict[str, _Tracked] = {}
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
        self._tracked[request_id] = _Tracked(request, rules)
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
        config.validate()
        strategy = config.resolved_strategy()
        if strategy not in SUPPORTED_STRATEGIES:
            raise ValueError(
                f"strategy {strategy!r} (num_beams={config.num_beams}) is not served; the "
                f"engine decodes {list(SUPPORTED_STRATEGIES)} (use llmlab.decoding.generate)"
            )
        if strategy == "beam" and config.do_sample:
            raise ValueError(
                f"beam sampling (num_beams={config.num_beams} with do_sample=True) is not served; "
                f"the engine runs deterministic beam search (do_sample=False), or use "
                f"llmlab.decoding.generate"
            )
        if config.sliding_window is not None or not config.use_cache:
            raise ValueError(
                "sliding_window and use_cache=False do not apply to the serving engine "
                "(it always caches, within max_model_len)"
            )
        vocab = self.model.config.vocab_size
        if not prompt_ids or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise ValueError(
                f"the prompt must be a non-empty list of token ids in [0, {vocab}), got "
                f"{list(prompt_ids)[:8]}{'...' if len(prompt_ids) > 8 else ''}"
            )
        limit = self.config.max_model_len
        new_tokens = 0 if options.prompt_only else config.max_new_tokens
        if len(prompt_ids) + new_tokens > limit:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                f"({new_tokens}) exceed the model's context of {limit} tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(options, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= vocab):
                raise ValueError(f"{name} must be an integer in [0, {vocab}], got {value!r}")
        if strategy == "beam" and (options.logprobs is not None or options.prompt_only):
            raise ValueError(
                f"num_beams={config.num_beams}: beam search reports no per-token "
                f"log-probabilities and always generates (logprobs and max_tokens=0 are not "
                f"served with it)"
            )
        for name in ("num_return_sequences", "num_beams"):
            if getattr(config, name) > self.config.max_num_seqs:
                raise ValueError(
                    f"{name}={getattr(config, name)} exceeds max_num_seqs="
                    f"{self.config.max_num_seqs}"
                )
        per_beam = -(-(len(prompt_ids) + config.max_new_tokens) // self.config.block_size)
        if strategy == "beam" and config.num_beams * per_beam > self.config.num_blocks:
            raise ValueError(
                f"num_beams={config.num_beams} beams of up to {len(prompt_ids)} + "
                f"{config.max_new_tokens} tokens may need {config.num_beams * per_beam} KV "
                f"blocks (no sharing), more than the pool's num_blocks={self.config.num_blocks}"
            )
        if config.stop_string_list and self.tokenizer is None:
            raise ValueError("stop strings need the engine to have a tokenizer")
        if config.seed is not None and not SEED_RANGE[0] <= config.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {config.seed}")
        if options.grammar is not None:
            if strategy == "beam":
                raise ValueError(
                    f"num_beams={config.num_beams}: structured output (a grammar) is served "
                    f"with greedy decoding and sampling, not beam search"
                )
            if self.tokenizer is None:
                raise ValueError("structured output needs the engine to have a tokenizer")
            self.grammars.check(options.grammar, list(config.eos_token_ids))

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
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        every_row = {i for i, c in enumerate(out.chunks) if _wants_prompt_rows(c)}
        masked, job, grammar_errors = self._start_masks(out.chunks)  # while the forward runs
        try:
            for chunk in out.chunks:
                fire("forward", self._tracked[chunk.seq.request.request_id].rules.fault)
            logits = self.runner.execute(out.chunks, out.copies, every_row)
        except Exception as err:
            if job is not None:
                job.future.exception()  # the masks' thread is done with the matchers
            ids = dict.fromkeys(c.seq.request.request_id for c in out.chunks)
            failed = [self._fail(rid, "forward", err) for rid in ids]
            self.stats.observe_queues(self.scheduler)
            return [f for f in failed if f is not None]
        self.scheduler.after_forward(out)
        failed: dict[str, RequestOutput | None] = {}
        refused = self._collect_masks(masked, job, grammar_errors, failed)
        if every_row:  # prompt log-probabilities; then one row per completing chunk
            logits = self._prompt_logprobs(out.chunks, every_row, logits, failed)
        raw = logits  # the model's logits: what log-probabilities are reported of
        if self.suppressed is not None:  # ids the tokenizer cannot decode are never chosen
            logits = logits.index_fill(1, self.suppressed, float("-inf"))
        seqs: list[Sequence] = []
        rows: list[int] = []
        grammar_rows: list[int | None] = []  # each sequence's row of `refused`, if it has one
        changed: dict[str, _Tracked] = {}
        beam_tokens = 0
        for row, chunk in enumerate(c for c in out.chunks if c.completes):
            request = chunk.seq.request
            rid = request.request_id
            if rid in failed:
                continue
            if request.beam is not None:  # the search steps once every beam has its logits
                beam_tokens += 1
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
        rules = [self._tracked[s.request.request_id].rules for s in seqs]
        if rows != list(range(logits.shape[0])):  # forks and beams: a gather (a copy)
            logits = logits[rows]
        if refused is not None:
            logits = _apply_masks(logits, refused, grammar_rows)
        tokens = next_tokens(seqs, rules, logits)
        for seq, token in zip(seqs, tokens):  # a failed choice fails its request first
            rid = seq.request.request_id
            if isinstance(token, Failure) and rid not in failed:
                failed[rid] = self._fail(rid, token.stage, token.error)
        self._token_logprobs(seqs, rows, tokens, raw, failed)
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
                    complete = _advance(seq.grammar, token)
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
        self.stats.step(out, generated + beam_tokens, self.scheduler)
        outputs = []
        for rid, tracked in changed.items():
            try:
                outputs.append(self._report(tracked))
            except Exception as err:
                failed[rid] = self._fail(rid, "detokenize", err)
        for output in outputs:
            if output.finished:
                finished = self._tracked.pop(output.request_id)
                self.stats.finished(finished.request, None)
        if failed:
            self.stats.observe_queues(self.scheduler)
        return outputs + [f for f in failed.values() if f is not None]

    def _start_masks(
        self, chunks: list[Chunk]
    ) -> tuple[dict[Sequence, int], MaskJob | None, dict[str, Exception]]:
        """Start computing the next-token masks of the sequences this step samples that follow
        a grammar (in a worker thread, while the forward runs): ``(sequence -> its row, the
        job, requests whose grammar stage failed already)``."""
        masked: dict[Sequence, int] = {}
        errors: dict[str, Exception] = {}
        for chunk in chunks:
            seq = chunk.seq
            if not chunk.completes or seq.grammar is None:
                continue
            rid = seq.request.request_id
            try:
                fire("grammar", self._tracked[rid].rules.fault)
            except Exception as err:
                errors[rid] = err
                continue
            masked[seq] = len(masked)
        if not masked:
            return masked, None, errors
        return masked, self.grammars.start([s.grammar for s in masked]), errors

    def _collect_masks(
        self,
        masked: dict[Sequence, int],
        job: MaskJob | None,
        errors: dict[str, Exception],
        failed: dict,
    ) -> Any:
        """The masks ``_start_masks`` computed ((rows, vocab) booleans, True where a token is
        refused; None if none); a request whose grammar failed ends here (the others' masks
        stand)."""
        for rid, err in errors.items():
            failed[rid] = self._fail(rid, "grammar", err)
        if job is None:
            return None
        try:
            refused = job.result()
        except Exception as err:
            for seq in masked:
                rid = seq.request.request_id
                if rid not in failed:
                    failed[rid] = self._fail(rid, "grammar", err)
            return None
        for seq in masked:
            rid = seq.request.request_id
            if seq.grammar.is_error() and rid not in failed:
                failed[rid] = self._fail(rid, "grammar", ValueError(seq.grammar.get_error()))
        return refused

    def _prompt_logprobs(
        self, chunks: list[Chunk], every_row: set[int], logits: Any, failed: dict
    ) -> Any:
        """Record the prompt tokens' log-probabilities from the rows kept for them (the row of
        position ``p`` gives token ``p + 1``'s); return the rows of the chunks that complete
        their sequence, one each, in order (what the step samples from)."""
        completing: list[int] = []
        r = 0
        for i, chunk in enumerate(chunks):
            if i not in every_row:
                if chunk.completes:
                    completing.append(r)
                    r += 1
                continue
            first, r = r, r + chunk.num_tokens
            if chunk.completes:
                completing.append(r - 1)
            request = chunk.seq.request
            rid = request.request_id
            if rid in failed or rid not in self._tracked:
                continue
            known = len(request.prompt_logprobs)  # tokens before `known` have theirs
            start = max(chunk.start, known - 1)
            stop = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
            if start >= stop:
                continue
            try:
                fire("logprobs", self._tracked[rid].rules.fault)
                rows = logits[first + start - chunk.start : first + stop - chunk.start]
                tokens = request.prompt_ids[start + 1 : stop + 1]
                top = [request.options.prompt_logprobs] * len(tokens)
                request.prompt_logprobs += token_logprobs(rows, tokens, top)
            except Exception as err:
                failed[rid] = self._fail(rid, "logprobs", err)
        return logits if len(completing) == logits.shape[0] else logits[completing]

    def _token_logprobs(
        self, seqs: list[Sequence], rows: list[int], tokens: list, raw: Any, failed: dict
    ) -> None:
        """Each chosen token's log-probability (and its step's most likely tokens) for the
        sequences whose request asks, from the model's logits ``raw`` (row ``rows[i]`` for
        ``seqs[i]``)."""
        want = []
        for i, seq in enumerate(seqs):
            rid = seq.request.request_id
            if seq.request.options.logprobs is None or rid in failed:
                continue
            try:
                fire("logprobs", self._tracked[rid].rules.fault)
            except Exception as err:
                failed[rid] = self._fail(rid, "logprobs", err)
                continue
            want.append(i)
        want = [i for i in want if seqs[i].request.request_id not in failed]
        if not want:
            return
        try:
            computed = token_logprobs(
                raw[[rows[i] for i in want]],
                [tokens[i] for i in want],
                [seqs[i].request.options.logprobs for i in want],
            )
        except Exception as err:
            for rid in dict.fromkeys(seqs[i].request.request_id for i in want):
                failed[rid] = self._fail(rid, "logprobs", err)
            return
        for i, logprob in zip(want, computed):
            seqs[i].logprobs.append(logprob)

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
            self._request_metrics(request),
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

    def _report(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        outputs = []
        for seq in request.sequences:
            seen = tracked.reported.get(seq.index, 0)
            generated = seq.output_ids
            new = generated[seen:]
            tracked.reported[seq.index] = len(generated)
            text, delta = self._text(tracked, seq, new)
            outputs.append(
                SequenceOutput(
                    seq.index,
                    list(generated),
                    text,
                    new,
                    delta,
                    seq.finish_reason,
                    seq.logprobs[seen:],
                )
            )
        prompt_logprobs = None
        wanted = request.options.prompt_logprobs is not None and not tracked.prompt_reported
        if wanted and not request.needs_prompt_logits:
            prompt_logprobs, tracked.prompt_reported = list(request.prompt_logprobs), True
        return RequestOutput(
            request.request_id,
            request.prompt_ids,
            outputs,
            request.is_finished,
            self._request_metrics(request),
            prompt_logprobs=prompt_logprobs,
        )

    def _text(self, tracked: _Tracked, seq: Sequence, new: list[int]) -> tuple[str, str]:
        if self.tokenizer is None:
            return "", ""
        text = tracked.texts.get(seq.index)
        if text is None:
            stops = tracked.request.config.stop_string_list
            text = tracked.texts[seq.index] = IncrementalText(self.tokenizer, stops)
        fire("detokenize", tracked.rules.fault)
        final = seq.status is Status.FINISHED
        if final and new and new[-1] in tracked.rules.eos:
            new = new[:-1]  # the eos token is special: not rendered
        delta = text.add(new, final=final)
        return text.text, delta

    @staticmethod
    def _request_metrics(request: Request) -> dict[str, float]:
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["time_to_first_token"] = request.first_token_time - request.arrival_time
        return metrics


def _apply_masks(logits: Any, refused: Any, grammar_rows: list[int | None]) -> Any:
    """``logits`` with ``-inf`` wherever row ``i``'s grammar (row ``grammar_rows[i]`` of
    ``refused``) refuses a token; rows with no grammar unchanged. A new tensor: the step's raw
    logits stay the model's (log-probabilities are reported from them)."""
    pick = [i for i, j in enumerate(grammar_rows) if j is not None]
    if not pick:
        return logits
    if grammar_rows != list(range(len(grammar_rows))) or refused.shape[0] != len(pick):
        full = torch.zeros(logits.shape, dtype=torch.bool)
        full[pick] = refused[[grammar_rows[i] for i in pick]]
        refused = full
    return logits.masked_fill(refused.to(logits.device, non_blocking=True), float("-inf"))


def _advance(matcher: Any, token: int) -> bool:
    """Advance a sequence's grammar by its chosen ``token``; whether the grammar is then
    complete (it takes no more tokens). A token the grammar refuses raises."""
    if not matcher.consume_token(token):
        raise ValueError(f"the grammar refused token {token}: {matcher.get_error()}")
    return matcher.is_stopped()


def _wants_prompt_rows(chunk: Chunk) -> bool:
    """Whether ``chunk`` computes prompt positions whose logits give a prompt token's
    log-probability that its request asked for and does not have yet."""
    request = chunk.seq.request
    return request.needs_prompt_logits and chunk.start < request.num_prompt_tokens - 1


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
