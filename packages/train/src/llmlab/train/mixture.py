"""The order of the training stream: which source each window comes from, and which window.

Both are functions of the stream position, computed when a batch is read, with no table that
grows with the corpus (the loader's memory stays flat at any size):

* **Which source** (``data.mix={web: 0.7, code: 0.3}``). Drawing a source at random per window
  meets the weights only on average: over 10,000 windows a 0.7 source lands within ±0.9 % of
  its share only 95 % of the time. Here the sources are the leaves of a balanced binary tree,
  and each node splits the positions that reach it between its two halves the way Bresenham
  draws a line: of the first ``n`` positions, ``round(n·L/W)`` go left (``L`` the left half's
  weight, ``W`` the node's). Position ``g`` goes left iff that count steps at ``g``, and arrives
  there as position ``round(g·L/W)`` of the left half (``g`` minus it on the right). Every run
  of ``n`` windows then holds ``w_s·n`` of source ``s`` to within ``⌈log₂ S⌉`` windows: every
  global batch has the mixture's proportions, not just the epoch.
* **Which window of the source** (:class:`Shuffle`): the source's ``k``-th window is
  ``shuffle_p(k mod n)`` on pass ``p = k div n`` over its ``n`` windows, a seeded bijection of
  ``[0, n)`` (a Feistel network), different on every pass. A source weighted above its size
  repeats, in a new order each pass; one weighted below it shows new windows each epoch.

Weights are quantised to multiples of 2⁻²⁰ (a relative error below 10⁻⁶) so that the counts
are exact integer arithmetic.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np

log = logging.getLogger(__name__)
QUANTUM = 1 << 20


def normalise_weights(mix: Mapping[str, Any]) -> dict[str, float]:
    """``mix`` scaled to sum to 1; every weight must be a positive number."""
    if not mix:
        raise ValueError("data.mix is empty; give {name: weight, ...} or null for one dataset")
    for name, w in mix.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"data.mix.{name}={w!r}: weights must be positive numbers")
    total = float(sum(mix.values()))
    return {name: float(w) / total for name, w in mix.items()}


def quantise(weights: Sequence[float]) -> list[int]:
    """Positive integers summing to ``QUANTUM``, each within 1 of ``w·QUANTUM`` (w normalised)."""
    exact = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * QUANTUM
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)  # a source with a weight is used
    short = QUANTUM - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: max(short, 0)]] += 1
    counts[np.argmax(counts)] += min(short, 0)  # what flooring tiny weights up to 1 added
    return [int(c) for c in counts]


@dataclass(frozen=True)
class _Node:
    """A split of the positions reaching it: ``round(n·left/total)`` of the first ``n`` go left."""

    left: _Node | int  # a subtree or a source index
    right: _Node | int
    left_weight: int
    total: int

    def lefts(self, n: np.ndarray) -> np.ndarray:
        """How many of the first ``n`` positions go left (exact integers, round half up)."""
        return (n * self.left_weight + self.total // 2) // self.total


def _tree(sources: list[int], weights: list[int]) -> _Node | int:
    if len(sources) == 1:
        return sources[0]
    mid = len(sources) // 2
    left = sum(weights[s] for s in sources[:mid])
    total = sum(weights[s] for s in sources)
    return _Node(_tree(sources[:mid], weights), _tree(sources[mid:], weights), left, total)


class MixtureSchedule:
    """Global stream position -> (source, that source's window count so far): see the module."""

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        self.names = list(names)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.root = _tree(list(range(len(self.names))), quantise(self.weights))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, stream index in that source) of each global position."""
        g = np.asarray(positions, dtype=np.int64)
        source, index = np.zeros_like(g), g.copy()
        stack: list[tuple[_Node | int, np.ndarray]] = [(self.root, np.arange(len(g)))]
        while stack:
            node, rows = stack.pop()
            if isinstance(node, int):
                source[rows] = node
                continue
            n = index[rows]
            before, after = node.lefts(n), node.lefts(n + 1)
            left = after > before
            index[rows] = np.where(left, before, n - before)
            stack += [(node.left, rows[left]), (node.right, rows[~left])]
        return source, index

    def counts(self, n: int) -> np.ndarray:
        """Windows of each source among global positions ``[0, n)``."""
        out = np.zeros(len(self.names), dtype=np.int64)
        stack: list[tuple[_Node | int, int]] = [(self.root, int(n))]
        while stack:
            node, m = stack.pop()
            if isinstance(node, int):
                out[node] = m
                continue
            lefts = int(node.lefts(np.int64(m)))
            stack += [(node.left, lefts), (node.right, m - lefts)]
        return out

    def describe(self) -> str:
        return ", ".join(f"{n} {w:.4f}" for n, w in zip(self.names, self.weights, strict=True))


class Shuffle:
    """A seeded bijection of ``[0, n)``: a 4-round Feistel network on the smallest even number
    of bits covering ``n``, walked until it lands inside ``[0, n)`` (at most 4 steps on
    average). Nothing is stored, unlike a permutation array of ``n`` entries."""

    MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: Fibonacci hashing

    def __init__(self, n: int, seed: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"nothing to shuffle: n={n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(list(seed)).integers(0, 2**63, size=4, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            mixed = (right ^ key) * self.MULTIPLIER  # wraps modulo 2^64, as intended
            left, right = right, left ^ ((mixed ^ (mixed >> np.uint64(29))) & self.mask)
        return (left << half) | right

    def __call__(self, i: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            y = self._encrypt(np.asarray(i, dtype=np.uint64))
            outside = y >= self.n
            while outside.any():  # cycle walking: a bijection of [0, 4^half) restricted to n
                y[outside] = self._encrypt(y[outside])
                outside = y >= self.n
        return y.astype(np.int64)


class MixtureProportions(L.Callback):
    """Logs ``data/mix/<source>``: the share of each source among every window trained on so
    far in this run (resumed runs included), counted from the positions the global batches took.

    ``progress()`` is the data module's ``(epoch, batches of it done)``. Global batch ``b`` of
    epoch ``e`` is positions ``e·N + [bB, (b+1)B)`` (an epoch uses the first ``⌊N/B⌋·B`` of its
    ``N``: the rule of :mod:`llmlab.train.global_batch`).
    """

    def __init__(
        self,
        schedule: MixtureSchedule,
        epoch_windows: int,
        batch_size: int,
        progress: Callable[[], tuple[int, int]],
    ) -> None:
        self.schedule, self.epoch_windows, self.batch_size = schedule, epoch_windows, batch_size
        self.progress = progress

    def seen(self) -> np.ndarray:
        epoch, done = self.progress()
        used = self.epoch_windows // self.batch_size * self.batch_size
        counts = self.schedule.counts
        total = np.zeros(len(self.schedule.names), dtype=np.int64)
        for e in range(epoch + 1):
            start = e * self.epoch_windows
            total += counts(start + (used if e < epoch else done * self.batch_size)) - counts(start)
        return total

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seen = self.seen()
        total = max(int(seen.sum()), 1)
        for name, n in zip(self.schedule.names, seen, strict=True):
            pl_module.log(f"data/mix/{name}", n / total, on_step=True, on_epoch=False)
