"""Which tokens of a sequence each context-parallel rank holds, and what attention that costs it.

The sequence of ``T`` tokens is cut into equal *pieces*; each of the ``N`` ranks holds some of
them, in ascending order, concatenated:

* ``contiguous``: ``N`` pieces, rank ``r`` holds piece ``r``. With a causal mask the query at
  position ``p`` scores ``p + 1`` keys, so the last rank does about ``2N − 1`` times the first
  rank's work (rank ``r`` of pieces of length ``P`` scores ``r·P² + P(P+1)/2`` pairs).
* ``zigzag`` (head-tail, the default): ``2N`` pieces, rank ``r`` holds pieces ``r`` and
  ``2N − 1 − r``: one cheap piece from the head and one expensive piece from the tail, so every
  rank scores exactly the same number of pairs, ``P·(T + 1) = T(T + 1) / (2N)``: the split of
  ``ring-flash-attention`` and Megatron-LM's context parallelism.

:func:`block_plan` says, for this rank's queries and one rank's key/value chunk, which
(query range, key range) blocks must be computed and which are on the mask's diagonal. Because
each rank's pieces are sorted, the keys a query piece sees fully are always a *prefix* of the
key chunk, so the plan is at most one full block per run of query pieces plus the diagonals.
:func:`attention_work` counts the scored pairs of that plan, per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCHEMES = ("zigzag", "contiguous")


@dataclass(frozen=True)
class ContextLayout:
    """How a sequence is split over ``degree`` context-parallel ranks (``scheme``: SCHEMES)."""

    degree: int
    scheme: str = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) or self.degree < 1:
            raise ValueError(f"context degree must be a positive integer, got {self.degree!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(
                f"unknown context-parallel split {self.scheme!r}; valid: {list(SCHEMES)}"
            )

    @property
    def num_pieces(self) -> int:
        """Pieces the whole sequence is cut into: ``2N`` for zigzag, ``N`` for contiguous."""
        return 2 * self.degree if self.scheme == "zigzag" else self.degree

    def pieces(self, rank: int) -> tuple[int, ...]:
        """The global piece indices ``rank`` holds, ascending."""
        if not 0 <= rank < self.degree:
            raise ValueError(
                f"rank {rank} is not in the context group; valid: 0..{self.degree - 1}"
            )
        if self.scheme == "zigzag":
            return (rank, 2 * self.degree - 1 - rank)
        return (rank,)

    def check_length(self, seq_len: int) -> int:
        """The piece length for a sequence of ``seq_len`` tokens; a clear error if it does not
        split into ``num_pieces`` equal pieces."""
        n = self.num_pieces
        if seq_len < n or seq_len % n:
            why = f"2 × context = {n}" if self.scheme == "zigzag" else f"context = {n}"
            lower = max(n, seq_len - seq_len % n)
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {why} (the {self.scheme} split "
                f"cuts it into {n} equal pieces); use a multiple of {n}, e.g. {lower} or "
                f"{lower + n}"
            )
        return seq_len // n

    def indices(self, rank: int, seq_len: int, device: torch.device | None = None) -> Tensor:
        """The global positions ``rank`` holds, in the order its local tensors store them."""
        size = self.check_length(seq_len)
        return torch.cat(
            [torch.arange(i * size, (i + 1) * size, device=device) for i in self.pieces(rank)]
        )

    def positions(self, rank: int, seq_len: int, device: torch.device | None = None) -> Tensor:
        """(1, T/N) position ids of ``rank``'s tokens, the models' ``positions`` argument (learned
        position table or RoPE angles): tokens keep their place in the *whole* sequence."""
        return self.indices(rank, seq_len, device).unsqueeze(0)

    def shard(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """``rank``'s part of ``x`` along the sequence dimension ``dim`` (ids, targets, position
        ids, hidden states)."""
        return x.index_select(dim, self.indices(rank, x.shape[dim], x.device))

    def unshard(self, parts: list[Tensor], dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (``parts[r]`` from rank ``r``)."""
        if len(parts) != self.degree:
            raise ValueError(f"need one part per rank ({self.degree}), got {len(parts)}")
        local = parts[0].shape[dim]
        seq_len = local * self.degree
        out = parts[0].new_empty((*parts[0].shape[:dim], seq_len, *parts[0].shape[dim + 1 :]))
        for rank, part in enumerate(parts):
            out.index_copy_(dim, self.indices(rank, seq_len, part.device), part)
        return out


@dataclass(frozen=True)
class Block:
    """One attention block of the ring: local query rows ``q`` against the held key/value rows
    ``k`` (``range`` objects into the local tensors), with the causal mask's diagonal or not."""

    q: range
    k: range
    diagonal: bool

    @property
    def pairs(self) -> int:
        """(query, key) pairs scored: a full block, or the lower triangle of a diagonal one."""
        if self.diagonal:
            return len(self.q) * (len(self.q) + 1) // 2
        return len(self.q) * len(self.k)


def block_plan(
    layout: ContextLayout, rank: int, source: int, seq_len: int, causal: bool
) -> list[Block]:
    """Blocks ``rank``'s queries compute against the key/value chunk of rank ``source``.

    Non-causal: one full block. Causal: query piece ``i`` sees key piece ``j`` fully when
    ``j < i``, on the diagonal when ``j == i``, not at all when ``j > i``. Adjacent query pieces
    that see the same key prefix are merged into one block (zigzag, a source below ``rank``:
    both query pieces see exactly the source's head piece, one call).
    """
    size = layout.check_length(seq_len)
    local = size * len(layout.pieces(rank))
    if not causal:
        return [Block(range(local), range(local), diagonal=False)]
    keys = layout.pieces(source)
    full: list[Block] = []
    diagonals: list[Block] = []
    for slot, piece in enumerate(layout.pieces(rank)):
        rows = range(slot * size, (slot + 1) * size)
        seen = sum(j < piece for j in keys)  # a prefix: the key pieces are sorted
        if seen:
            last = full[-1] if full else None
            if last is not None and last.k.stop == seen * size and last.q.stop == rows.start:
                full[-1] = Block(range(last.q.start, rows.stop), last.k, diagonal=False)
            else:
                full.append(Block(rows, range(seen * size), diagonal=False))
        if seen < len(keys) and keys[seen] == piece:
            diagonals.append(Block(rows, range(seen * size, (seen + 1) * size), diagonal=True))
    return full + diagonals


def attention_work(layout: ContextLayout, seq_len: int, causal: bool = True) -> list[int]:
    """(query, key) pairs each rank scores in one ring pass, from :func:`block_plan`.

    Causal totals ``T(T+1)/2`` over the ranks; contiguous gives rank ``r`` about ``(2r + 1)``
    times rank 0's share, zigzag gives every rank ``T(T+1) / (2N)``.
    """
    return [
        sum(
            block.pairs
            for source in range(layout.degree)
            for block in block_plan(layout, rank, source, seq_len, causal)
        )
        for rank in range(layout.degree)
    ]


def work_imbalance(layout: ContextLayout, seq_len: int, causal: bool = True) -> float:
    """max / min of :func:`attention_work` over the ranks (1.0: perfectly balanced)."""
    work = attention_work(layout, seq_len, causal)
    return max(work) / min(work)
