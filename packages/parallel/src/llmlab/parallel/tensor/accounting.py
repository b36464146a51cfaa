"""Every tensor-parallel collective is recorded: its kind, its payload bytes and its wire bytes.

Why count: tensor parallelism trades compute for communication, and the trade is only visible if
the bytes are measured, not assumed. ``CommLedger`` is a plain, process-local list of records;
the collectives in :mod:`llmlab.parallel.tensor.primitives` append to the active ledger, and the
strategy logs one step's totals as ``tp/comm_bytes``.

Two figures per collective, for a tensor of ``S`` bytes (the full, unsharded size) on ``n`` ranks:

* ``bytes`` (payload): ``S`` for an all-reduce, for the output of an all-gather and for the
  input of a reduce-scatter: the ``B×T×d`` figure Megatron-LM's papers reason with.
* ``wire_bytes``: what one rank sends with the bandwidth-optimal ring algorithm:
  ``2(n-1)/n·S`` for an all-reduce and ``(n-1)/n·S`` for an all-gather or a reduce-scatter. With
  sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather: same wire bytes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class CommRecord:
    kind: str  # one of KINDS
    bytes: int  # payload: the full tensor's size in bytes
    wire_bytes: float  # ring-algorithm bytes sent by one rank
    group_size: int
    tag: str = ""  # which mapping issued it (e.g. "copy_to_tensor_region.backward")


@dataclass
class CommLedger:
    """A list of ``CommRecord``; ``totals()`` sums them by kind."""

    records: list[CommRecord] = field(default_factory=list)

    def add(self, kind: str, payload_bytes: int, group_size: int, tag: str = "") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; valid: {list(KINDS)}")
        share = (group_size - 1) / group_size
        wire = 2 * share * payload_bytes if kind == "all_reduce" else share * payload_bytes
        self.records.append(CommRecord(kind, int(payload_bytes), wire, group_size, tag))

    def clear(self) -> None:
        self.records.clear()

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def total_wire_bytes(self) -> float:
        return sum(r.wire_bytes for r in self.records)

    def totals(self) -> dict[str, int]:
        """Payload bytes per kind (every kind present, zero if unused)."""
        out: dict[str, int] = dict.fromkeys(KINDS, 0)
        for r in self.records:
            out[r.kind] += r.bytes
        return out

    def by_tag(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.tag] += r.bytes
        return dict(out)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys(KINDS, 0)
        for r in self.records:
            out[r.kind] += 1
        return out


_LEDGER = CommLedger()


def comm_ledger() -> CommLedger:
    """The process-wide ledger every tensor-parallel collective appends to."""
    return _LEDGER


@contextmanager
def record_into(ledger: CommLedger) -> Iterator[CommLedger]:
    """Collectives issued inside the block go to ``ledger`` (the previous one is restored)."""
    global _LEDGER
    previous, _LEDGER = _LEDGER, ledger
    try:
        yield ledger
    finally:
        _LEDGER = previous


def count_comm() -> contextlib.AbstractContextManager[CommLedger]:
    """A fresh ledger for the duration of the block: ``with count_comm() as ledger: ...``."""
    return record_into(CommLedger())
