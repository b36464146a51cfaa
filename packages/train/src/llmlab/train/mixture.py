"""Mixtures of prepared datasets: which source each training window comes from, and in what order.

``data.mix={web: 0.7, code: 0.3}`` asks for 70 % of the windows from ``web``. Sampling a source
at random per window (the simple way) meets the weights only on average: over 10,000 windows a
0.7 source lands within ±0.9 % of its share only 95 % of the time. Here the sources are laid
out deterministically instead, as stride scheduling does for CPU shares: an epoch of ``N``
windows gives source ``s`` exactly ``c_s = round(w_s·N)`` slots, its ``k``-th slot at time
``(k + ½) / c_s``, and the slots are taken in time order. Every stretch of ``n`` consecutive
windows then holds ``w_s·n`` windows of ``s`` to within a couple, so every global batch has
the mixture's proportions, not just the epoch.

Which window of a source fills its slot is the source's own business (``TokenDataModule``
draws them from a seeded permutation, pass after pass), so a source weighted above its size
repeats, in a new order each pass, and one weighted below it shows new windows each epoch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np

log = logging.getLogger(__name__)


def normalise_weights(mix: Mapping[str, Any]) -> dict[str, float]:
    """``mix`` scaled to sum to 1; every weight must be a positive number."""
    if not mix:
        raise ValueError("data.mix is empty; give {name: weight, ...} or null for one dataset")
    for name, w in mix.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"data.mix.{name}={w!r}: weights must be positive numbers")
    total = float(sum(mix.values()))
    return {name: float(w) / total for name, w in mix.items()}


def epoch_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Integers summing to ``total``, each within 1 of ``w·total`` (largest remainders)."""
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    short = int(total - counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(source, k)`` of every slot of an epoch: slot ``j`` is source ``source[j]``'s
    ``k[j]``-th window of the epoch, the sources spread evenly (stride scheduling)."""
    times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c > 0])
    source = np.concatenate([np.full(c, s, dtype=np.int32) for s, c in enumerate(counts)])
    k = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.argsort(times, kind="stable")  # a tie goes to the source listed first
    return source[order], k[order]


class MixtureSchedule:
    """The order of the training stream: global position ``g = epoch·N + j`` is source
    ``source[j]``'s window number ``epoch·c_s + k[j]`` of its endless stream of windows."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], epoch_windows: int):
        if epoch_windows < 1:
            raise ValueError(f"a mixture epoch needs at least one window, got {epoch_windows}")
        self.names = list(names)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.epoch_windows = int(epoch_windows)
        self.counts = epoch_counts(self.weights, self.epoch_windows)
        # One source needs no table: slot j is its window j (8 bytes a window saved).
        self._single = len(self.names) == 1
        if not self._single:
            self.source, self.slot = interleave(self.counts)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, stream index) of each global position."""
        g = np.asarray(positions, dtype=np.int64)
        if self._single:
            return np.zeros_like(g), g
        epoch, j = np.divmod(g, self.epoch_windows)
        src = self.source[j]
        return src, epoch * self.counts[src] + self.slot[j]

    def counts_between(self, start: int, stop: int) -> np.ndarray:
        """Windows of each source at global positions ``[start, stop)`` of one epoch."""
        if self._single:
            return np.array([stop - start], dtype=np.int64)
        epoch = start // self.epoch_windows
        lo, hi = start - epoch * self.epoch_windows, stop - epoch * self.epoch_windows
        if not 0 <= lo <= hi <= self.epoch_windows:
            raise ValueError(f"positions [{start}, {stop}) are not inside one epoch")
        return np.bincount(self.source[lo:hi], minlength=len(self.names)).astype(np.int64)

    def describe(self) -> str:
        return ", ".join(
            f"{n} {c / self.epoch_windows:.4f} (weight {w:.4f}, {c} windows)"
            for n, w, c in zip(self.names, self.weights, self.counts, strict=True)
        )


class MixtureProportions(L.Callback):
    """Logs ``data/mix/<source>``: the share of each source among every window trained on so
    far in this run (resumed runs included), counted from the positions the global batches took.

    ``progress()`` is the data module's ``(epoch, batches of it done)``; each global batch ``b``
    of epoch ``e`` is positions ``e·N + [bB, (b+1)B)`` (``drop_last``: an epoch uses
    ``⌊N/B⌋·B`` of them), the rule of :mod:`llmlab.train.global_batch`.
    """

    def __init__(self, schedule: MixtureSchedule, batch_size: int, progress: Any) -> None:
        self.schedule, self.batch_size, self.progress = schedule, batch_size, progress
        self.seen = np.zeros(len(schedule.names), dtype=np.int64)

    def used_per_epoch(self) -> int:
        return self.schedule.epoch_windows // self.batch_size * self.batch_size

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch, done = self.progress()
        full = self.schedule.counts_between(0, self.used_per_epoch()) * epoch
        start = epoch * self.schedule.epoch_windows
        self.seen = full + self.schedule.counts_between(start, start + done * self.batch_size)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        epoch, done = self.progress()  # done counts this batch
        start = epoch * self.schedule.epoch_windows + (done - 1) * self.batch_size
        self.seen += self.schedule.counts_between(start, start + self.batch_size)
        total = max(int(self.seen.sum()), 1)
        for name, n in zip(self.schedule.names, self.seen, strict=True):
            pl_module.log(f"data/mix/{name}", n / total, on_step=True, on_epoch=False)
