"""Shared plumbing for benchmarks: best-of-N timing and one JSON format for `make bench`.

Every benchmark measures llmlab and its reference in the same run and reports ratios, because
these machines are shared and noisy: absolute times are printed for context, never compared.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def report(benchmark: str, rows: list[Row], notes: str = "", skipped: str | None = None) -> Path:
    """Print a table of ``rows`` and write ``benchmarks/results/<benchmark>.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
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
    path = RESULTS_DIR / f"{benchmark}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


# Wall-clock time at the end of each training step, appended by ``benchmarks.train.StepTimer``.
# It lives here because Hydra imports that callback as ``benchmarks.train`` while the benchmark
# itself runs as ``__main__``: two copies of that module, one of this one.
STEP_TIMES: list[float] = []
