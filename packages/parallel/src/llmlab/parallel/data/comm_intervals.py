"""Per-step timestamps of gradient communication, shared by the strategies and ``StepAnatomy``.

A strategy appends one ``(start, end)`` interval (``time.perf_counter`` seconds) per message
burst — a bucket's all-reduce, a push/pull to a parameter server — and marks when autograd
finished computing gradients; the callback turns these into "comm hidden under backward" and
"comm exposed" per step. Keeping it a plain list avoids coupling strategies to the callback.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CommTimeline:
    events: list[tuple[float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, start: float, end: float) -> None:
        with self._lock:  # completion callbacks run on communication threads
            self.events.append((start, end))

    def drain(self) -> list[tuple[float, float]]:
        with self._lock:
            out, self.events = self.events, []
        return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by at least one interval."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``intervals`` inside [lo, hi]."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]
