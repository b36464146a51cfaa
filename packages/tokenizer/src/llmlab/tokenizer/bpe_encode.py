"""The reference byte-level BPE encoder: readable, rank-ordered, and linear-ish on long chunks.

Rule (tiktoken's): within one pre-tokenized chunk, repeatedly merge the adjacent pair of parts
whose concatenated bytes have the *lowest rank*; among equal ranks the leftmost pair goes first.
A chunk that is itself a token is returned at once.

Short chunks use the direct O(n^2) loop (fast for the usual 2-10 bytes). Long chunks (a 1 MB run
of one character is a single chunk) use a linked list of parts and a heap keyed by
``(rank, position)``: the same choice at every step, in O(n log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import chain

HEAP_THRESHOLD = 64
_INF = 1 << 62


def _merge_small(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's loop: ``bounds`` delimit the parts, ``pair_ranks[i]`` is the rank of parts
    i and i+1 joined. ``min`` + ``index`` (both in C) find the lowest, leftmost pair; only the
    two neighbouring pair ranks change after a merge."""
    get = ranks.get
    inf = _INF
    bounds = list(range(len(piece) + 1))
    pair_ranks = [get(piece[i : i + 2], inf) for i in range(len(piece) - 1)]
    while pair_ranks:
        best = min(pair_ranks)
        if best == inf:
            break
        i = pair_ranks.index(best)
        del bounds[i + 1]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = get(piece[bounds[i - 1] : bounds[i + 1]], inf)
        if i < len(pair_ranks):
            pair_ranks[i] = get(piece[bounds[i] : bounds[i + 2]], inf)
    return [ranks[piece[bounds[k] : bounds[k + 1]]] for k in range(len(bounds) - 1)]


def _merge_large(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    n = len(piece)
    nxt = list(range(1, n + 1))  # part starting at i ends at nxt[i]
    prv = list(range(-1, n - 1))
    alive = [True] * n
    get = ranks.get
    heap: list[tuple[int, int, int, int]] = []  # (rank, start, mid, end)
    for i in range(n - 1):
        rank = get(piece[i : i + 2])
        if rank is not None:
            heap.append((rank, i, i + 1, i + 2))
    heapq.heapify(heap)
    while heap:
        _, i, mid, end = heapq.heappop(heap)
        if not alive[i] or nxt[i] != mid or mid >= n or nxt[mid] != end:
            continue  # stale: one of the two parts has merged since
        alive[mid] = False
        nxt[i] = end
        if end < n:
            prv[end] = i
        p = prv[i]
        if p >= 0:
            rank = get(piece[p:end])
            if rank is not None:
                heapq.heappush(heap, (rank, p, i, end))
        if end < n:
            rank = get(piece[i : nxt[end]])
            if rank is not None:
                heapq.heappush(heap, (rank, i, end, nxt[end]))
    out = []
    i = 0
    while i < n:
        out.append(ranks[piece[i : nxt[i]]])
        i = nxt[i]
    return out


def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Token ids of one chunk's bytes under ``ranks`` (every single byte must have a rank)."""
    rank = ranks.get(piece)
    if rank is not None:
        return [rank]
    if len(piece) < HEAP_THRESHOLD:
        return _merge_small(piece, ranks)
    return _merge_large(piece, ranks)


def concat_cached(
    items: list[str], cache: dict[str, list[int]], compute: Callable[[str], list[int]], limit: int
) -> list[int]:
    """``compute(item)`` of every item, concatenated. Each distinct unseen item is computed once
    into ``cache`` (cleared when it would pass ``limit`` entries), then the lookups run as
    ``map`` over the cache in C: no Python-level loop per item."""
    new = {item: compute(item) for item in set(items).difference(cache)}
    if new:
        if len(cache) + len(new) > limit:
            cache.clear()
        cache.update(new)
    return list(chain.from_iterable(map(cache.__getitem__, items)))


class ChunkCache:
    """chunk text -> ids, bounded: natural text repeats a small set of chunks very often."""

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self.data: dict[str, list[int]] = {}

    def encode_chunks(self, chunks: list[str], ranks: dict[bytes, int]) -> list[int]:
        """Ids of ``chunks`` in order. Only distinct unseen chunks go through ``bpe_merge``;
        the per-chunk lookups run as ``map`` over dict methods (no Python-level loop)."""
        data = self.data
        new = {c: bpe_merge(c.encode("utf-8"), ranks) for c in set(chunks).difference(data)}
        if new:
            if len(data) + len(new) > self.max_entries:
                data.clear()
            data.update((c, ids) for c, ids in new.items() if len(c) < 256)
        # new.get(chunk, data.get(chunk)): long chunks are looked up in ``new`` only
        return list(chain.from_iterable(map(new.get, chunks, map(data.get, chunks))))


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[int, int]]:
    """Recover the merge list from ranks alone (for ``.tiktoken`` / GPT-2 vocabularies).

    Token ``t`` of rank ``r`` was made by the last merge of BPE-encoding ``t`` with only the
    tokens ranked below ``r``: that encoding leaves exactly two parts, ``t``'s merge.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _merge_small_below(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(
                f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens"
            )
        merges.append((ranks[parts[0]], ranks[parts[1]]))
    return merges


def _merge_small_below(piece: bytes, ranks: dict[bytes, int], limit: int) -> list[bytes]:
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts
