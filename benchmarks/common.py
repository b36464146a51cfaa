"""Shared plumbing for benchmarks: best-of-N timing, one JSON format for `make bench`, smoke runs.

Every benchmark measures llmlab and its reference in the same run and reports ratios, because
these machines are shared and noisy: absolute times are printed for context, never compared.

Every benchmark also takes ``--smoke`` (:func:`parse_args`): tiny sizes, one repeat, done in
seconds, to check that the script runs (the test suite runs each one so). A smoke run's figures
mean nothing, so they must never replace the committed ones: :func:`start_smoke` points
:func:`results_dir` (and through the environment, any process the benchmark starts) at a scratch
directory, ``$LLMLAB_BENCH_RESULTS`` if set, else a fresh temporary one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_ENV = "LLMLAB_BENCH_RESULTS"  # where results go instead of RESULTS_DIR (smoke runs)


def results_dir() -> Path:
    """Where ``report`` and other result files go: ``$LLMLAB_BENCH_RESULTS`` or ``results/``."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)


def start_smoke() -> Path:
    """Send this run's results to a scratch directory (kept in the environment, so processes
    the benchmark spawns write there too); return it."""
    scratch = os.environ.get(RESULTS_ENV) or tempfile.mkdtemp(prefix="llmlab-bench-smoke-")
    os.environ[RESULTS_ENV] = scratch
    print(f"smoke run: tiny sizes, one repeat; results go to {scratch}")
    return Path(scratch)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Any:
    """``parser.parse_args(argv)`` with the common ``--smoke`` flag; starts smoke mode if set."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, one repeat (seconds): checks the script; results go to a scratch "
        f"directory (${RESULTS_ENV} or a temporary one), never to benchmarks/results",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        start_smoke()
    return args


def best_of(
    fn: Callable[[], Any],
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best time in seconds of ``repeats`` calls after ``warmup`` untimed calls; wall time by
    default, ``clock=time.process_time`` for this process's CPU time."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def decode_rate(
    run: Callable[[int], Any],
    new_tokens: int,
    repeats: int,
    batch: int = 1,
    between: Callable[[], Any] | None = None,
    rounds: list[tuple[float, float]] | None = None,
) -> float:
    """Tokens/s of decoding alone: batch × (N - 1) / (t(N) - t(1)), each the best of
    ``repeats`` (where noise makes the difference non-positive, as at smoke sizes, the whole
    run's rate, prompt included). ``between`` runs untimed before each round (a probe of the
    machine measured in the same time window, such as a memory read rate); ``rounds``, if
    given, receives each round's ``(t(1), t(N))``."""
    run(2)  # warm-up (compiles the quantized products on first use)
    t_one = t_all = float("inf")
    for _ in range(repeats):
        if between is not None:
            between()
        start = time.perf_counter()
        run(1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        run(new_tokens)
        everything = time.perf_counter() - start
        t_one, t_all = min(t_one, one), min(t_all, everything)
        if rounds is not None:
            rounds.append((one, everything))
    spent = t_all - t_one
    if spent <= 0:  # noise larger than the decode (tiny smoke sizes): the whole run's rate
        return batch * new_tokens / t_all
    return batch * (new_tokens - 1) / spent


@dataclass
class Row:
    """One comparison: llmlab's figure, the reference's figure, and their ratio.

    ``higher_is_better`` says which way the ratio points (throughput: True; time: False), so the
    ratio is always "how many times better llmlab is" (> 1 means llmlab wins).
    """

    name: str
    llmlab: float
    reference: float
    reference_name: str
    unit: str
    higher_is_better: bool = True
    target: float | None = None  # minimum acceptable ratio, if the issue sets one
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        if self.llmlab == 0 or self.reference == 0:
            return float("nan")
        if self.higher_is_better:
            return self.llmlab / self.reference
        return self.reference / self.llmlab

    @property
    def meets_target(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


def fair(cold: bool, runs: int, warmup: int = 0, engines: tuple[str, str] = ("", "")) -> dict:
    """``Row.extra`` entries saying how a timed row was timed, the same for both of its sides:
    every timed run ``cold`` (a fresh encoder, empty caches) or warm; ``runs`` timed runs of each
    side (the best kept); ``warmup`` untimed runs of each before them; ``engines``: the code doing
    each side's work. A timed row whose two sides run the same code (llmlab's byte-level fast
    path is tiktoken's own core) measures noise around 1, so it carries no target.
    :func:`fairness_problems` checks a reported row."""
    return {"timed": True, "cold": cold, "runs": runs, "warmup": warmup, "engines": list(engines)}


def untimed(engines: tuple[str, str]) -> dict:
    """``Row.extra`` of a row that compares no timings (memory, a fraction against a bound)."""
    return {"timed": False, "engines": list(engines)}


def fairness_problems(row: dict[str, Any]) -> list[str]:
    """What a reported row (one of ``report``'s JSON rows) lacks of :func:`fair`'s (or
    :func:`untimed`'s) record, or breaks of its rules; empty when the row is fair by its record."""
    extra = row.get("extra") or {}
    problems = []
    engines = extra.get("engines")
    if not (isinstance(engines, list) and len(engines) == 2 and all(engines)):
        problems.append("no engines named for its two sides")
    if extra.get("timed") is False:
        return problems
    if extra.get("timed") is not True:
        problems.append("no timed/untimed record")
    if not isinstance(extra.get("cold"), bool):
        problems.append("no cold/warm record")
    if not isinstance(extra.get("runs"), int) or extra["runs"] < 1:
        problems.append("no count of timed runs")
    if not isinstance(extra.get("warmup"), int) or extra["warmup"] < 0:
        problems.append("no count of warm-up runs")
    if not problems and engines[0] == engines[1] and row.get("target") is not None:
        problems.append(f"a target on a timed row whose two sides both run {engines[0]}")
    return problems


def report(benchmark: str, rows: list[Row], notes: str = "", skipped: str | None = None) -> Path:
    """Print a table of ``rows`` and write ``<results_dir()>/<benchmark>.json``."""
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    if skipped:
        print(f"{benchmark}: skipped: {skipped}")
    else:
        print(f"\n{benchmark}")
        header = f"{'case':<44} {'llmlab':>12} {'reference':>12} {'ratio':>7}  target  vs"
        print(header)
        print("-" * len(header))
        for r in rows:
            target = "" if r.target is None else f">={r.target:g}"
            mark = {True: "ok", False: "MISS", None: ""}[r.meets_target]
            print(
                f"{r.name:<44} {r.llmlab:>12.4g} {r.reference:>12.4g} {r.ratio:>7.2f}  "
                f"{target:<6} {r.reference_name} ({r.unit}) {mark}"
            )
        if notes:
            print(notes)
    payload = {
        "benchmark": benchmark,
        "skipped": skipped,
        "notes": notes,
        "rows": [{**asdict(r), "ratio": r.ratio, "meets_target": r.meets_target} for r in rows],
    }
    path = out_dir / f"{benchmark}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


# Wall-clock time at the end of each training step, appended by ``benchmarks.train.StepTimer``.
# It lives here because Hydra imports that callback as ``benchmarks.train`` while the benchmark
# itself runs as ``__main__``: two copies of that module, one of this one.
STEP_TIMES: list[float] = []
