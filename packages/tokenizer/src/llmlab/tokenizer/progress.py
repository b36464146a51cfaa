"""A dependency-free progress line on stderr for long trainings (tqdm is not a dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints ``label: done/total (rate/s)`` at most every ``interval`` seconds when enabled."""

    def __init__(self, label: str, total: int, enabled: bool, interval: float = 0.5):
        self.label, self.total, self.enabled, self.interval = label, total, enabled, interval
        self.start = self.last = time.perf_counter()
        self.done = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._print(now)

    def close(self) -> None:
        if self.enabled:
            self._print(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} ({rate:,.0f}/s)")
        sys.stderr.flush()
