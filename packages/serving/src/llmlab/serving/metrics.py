"""Engine counters and their Prometheus text exposition (``GET /metrics``).

Gauges say what the engine holds now (waiting and running sequences, KV blocks used), counters
what it has done (prompt and generated tokens, preemptions, finished requests by reason), a
histogram how long requests waited for their first token, and a gauge the generation rate over
the last ``window`` seconds of steps. The HTTP thread reads these while the engine thread
updates them, so reads copy or tolerate a change in between. The text format is Prometheus'
0.0.4 exposition format, written by hand (a dozen lines; no client library needed) and checked
in the tests with ``prometheus_client``'s parser. A counter is written as ``prometheus_client``
writes one in that format: its ``# HELP`` and ``# TYPE`` lines and its samples all name
``<name>_total`` (the parser files them under the family ``<name>``; a ``# TYPE <name>
counter`` line followed by ``<name>_total`` samples would leave the family empty and the
samples under an untyped one).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return [*out, f"{name}_sum {self.total}", f"{name}_count {self.n}"]


@dataclass
class EngineStats:
    num_blocks: int
    window: float = 10.0
    waiting: int = 0
    running: int = 0
    blocks_used: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0  # blocks
    prefix_cache_queries: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # request errors by kind: the HTTP layer's refusals (invalid_request, model_not_found,
    # not_found, method_not_allowed, body_too_large, internal) and the engine's failed
    # requests by stage (forward, logits, sampling, detokenize, engine); both threads count
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    _errors_lock: threading.Lock = field(default_factory=threading.Lock)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    _recent: deque = field(default_factory=deque)  # (time, generated tokens) of recent steps
    _recent_tokens: int = 0  # their sum
    speculator: Any = None  # the engine's llmlab.serving.speculation.Speculator, if it drafts

    def step(self, out: Any, generated: int, scheduler: Any) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.generated_tokens += generated
        self.prompt_tokens += sum(
            max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start)
            for c in out.chunks
        )
        self.observe_queues(scheduler)
        self._recent.append((now, generated))
        self._recent_tokens += generated
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent_tokens -= self._recent.popleft()[1]

    def observe_queues(self, scheduler: Any) -> None:
        blocks = scheduler.blocks.stats()
        self.waiting, self.running = len(scheduler.waiting), len(scheduler.running)
        self.blocks_used = blocks.used
        self.preemptions = scheduler.num_preemptions
        self.prefix_cache_hits, self.prefix_cache_queries = blocks.hits, blocks.queries

    def error(self, kind: str) -> None:
        with self._errors_lock:
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, request: Any, reason: str | None) -> None:
        reasons = [reason] if reason else [s.finish_reason for s in request.sequences]
        for r in reasons:
            self.finished_by_reason[r] = self.finished_by_reason.get(r, 0) + 1

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ``window`` seconds."""
        try:  # read from the HTTP thread while the engine thread steps: no check-then-use
            first = self._recent[0][0]
        except IndexError:
            return 0.0
        return self._recent_tokens / max(time.perf_counter() - first, 1e-3)

    def prometheus(self, prefix: str = "llmlab") -> str:
        def metric(name: str, kind: str, help_: str, lines: list[str]) -> list[str]:
            return [f"# HELP {prefix}_{name} {help_}", f"# TYPE {prefix}_{name} {kind}", *lines]

        p = prefix
        out: list[str] = []
        for name, value, help_ in (
            ("num_requests_waiting", self.waiting, "Sequences waiting to be scheduled."),
            ("num_requests_running", self.running, "Sequences holding KV blocks."),
            ("kv_blocks_used", self.blocks_used, "KV cache blocks in use."),
            ("kv_blocks_total", self.num_blocks, "KV cache blocks in the pool."),
            ("generation_tokens_per_second", self.tokens_per_second,
             f"Generated tokens per second over the last {self.window:g} s."),
        ):  # fmt: skip
            out += metric(name, "gauge", help_, [f"{p}_{name} {value}"])
        for name, value, help_ in (
            ("prompt_tokens", self.prompt_tokens, "Prompt tokens computed."),
            ("generation_tokens", self.generated_tokens, "Tokens generated."),
            ("preemptions", self.preemptions, "Sequences preempted for lack of KV blocks."),
            ("prefix_cache_hits", self.prefix_cache_hits, "Blocks reused from the prefix cache."),
            ("prefix_cache_queries", self.prefix_cache_queries, "Full prompt blocks looked up."),
        ):
            out += metric(f"{name}_total", "counter", help_, [f"{p}_{name}_total {value}"])
        if self.speculator is not None:
            spec = self.speculator
            for name, value, help_ in (
                ("spec_decode_num_draft_tokens", spec.proposed, "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens", spec.accepted, "Draft tokens accepted."),
                ("spec_decode_num_drafts", spec.drafted_steps, "Sequence steps with drafts."),
            ):
                out += metric(f"{name}_total", "counter", help_, [f"{p}_{name}_total {value}"])
            out += metric(
                "spec_decode_acceptance_rate",
                "gauge",
                "Accepted over verified draft tokens since start.",
                [f"{p}_spec_decode_acceptance_rate {spec.acceptance_rate}"],
            )
        out += metric(
            "request_success_total",
            "counter",
            "Finished sequences by finish reason.",
            [
                f'{p}_request_success_total{{finished_reason="{r}"}} {n}'
                for r, n in sorted(dict(self.finished_by_reason).items())
            ],
        )
        with self._errors_lock:
            errors = sorted(self.errors_by_kind.items())
        out += metric(
            "request_errors_total",
            "counter",
            "Requests refused or failed, by kind.",
            [f'{p}_request_errors_total{{kind="{k}"}} {n}' for k, n in errors],
        )
        out += metric(
            "time_to_first_token_seconds",
            "histogram",
            "Seconds from arrival to first token.",
            self.ttft.lines(f"{p}_time_to_first_token_seconds"),
        )
        return "\n".join(out) + "\n"
