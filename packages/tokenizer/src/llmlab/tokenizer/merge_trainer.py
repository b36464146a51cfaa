"""Incremental pair-merge training, shared by byte-level BPE and WordPiece.

The corpus is reduced to *distinct words* (pre-tokenized chunks) with counts, each word a list of
symbol ids. One merge replaces every occurrence of the best adjacent pair ``(a, b)`` by a new
symbol. Instead of recounting the corpus after each merge:

- ``pair_counts[p]`` holds the count-weighted number of occurrences of pair ``p``;
- ``where[p]`` holds the indices of the words that contain ``p`` (a superset: entries may be
  stale, a word is re-checked before it is touched);
- a max-heap gives the best pair. It is *lazy*: an entry whose count no longer matches
  ``pair_counts`` is re-pushed with the current count when popped; a count that grows gets a
  fresh entry at once (only pairs containing the new symbol can grow).

A merge touches only the words in ``where[(a, b)]``, so a training costs
O(sum over merges of the affected words' lengths), and memory is O(distinct words).

Tie-break (documented and deterministic): the pair with the highest count wins; among equal
counts, the smaller ``(a, b)`` tuple of ids wins. This is HF ``tokenizers``' BpeTrainer rule, and
with llmlab's id layout (special tokens, then bytes in HF's alphabet order) it reproduces HF's
merge list. Iteration order of sets never matters: counts are summed before the heap sees them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import TypeVar

from llmlab.tokenizer.progress import Progress

T = TypeVar("T", bound=Hashable)


def merge_word(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...] | None:
    """Replace each non-overlapping ``a b`` (left to right) by ``new``; None if absent."""
    n = len(word)
    i = 0
    out: list[int] = []
    found = False
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
            found = True
        else:
            out.append(word[i])
            i += 1
    return tuple(out) if found else None


def train_merges(
    words: list[tuple[int, ...]],
    counts: list[int],
    tokens: list[T],
    vocab_size: int,
    concat: Callable[[T, T], T],
    min_frequency: int = 0,
    show_progress: bool = False,
) -> list[tuple[int, int]]:
    """Learn merges until ``len(set(tokens)) == vocab_size`` or no pair is frequent enough.

    ``tokens`` (id -> token value) is extended in place with each new token; a merge whose
    result already exists reuses that id (as HF does). ``words`` is rewritten in place.
    Returns the merges as pairs of ids, in order.
    """
    token_ids: dict[T, int] = {t: i for i, t in enumerate(tokens)}
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (word, count) in enumerate(zip(words, counts)):
        for pair in itertools.pairwise(word):
            pair_counts[pair] += count
            where[pair].add(wi)
    heap = [(-c, a, b) for (a, b), c in pair_counts.items() if c > 0]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    progress = Progress("bpe merges", max(vocab_size - len(token_ids), 0), show_progress)
    while len(token_ids) < vocab_size and heap:
        neg_count, a, b = heapq.heappop(heap)
        current = pair_counts.get((a, b), 0)
        if -neg_count != current:  # stale entry: re-queue with the true count
            if current > 0:
                heapq.heappush(heap, (-current, a, b))
            continue
        if current < 1 or current < min_frequency:
            break
        value = concat(tokens[a], tokens[b])
        new = token_ids.get(value)
        if new is None:
            new = len(tokens)
            tokens.append(value)
            token_ids[value] = new
        merges.append((a, b))

        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop((a, b), ()):
            old = words[wi]
            merged = merge_word(old, a, b, new)
            if merged is None:
                continue  # stale index: an earlier merge consumed this pair
            count = counts[wi]
            for pair in itertools.pairwise(old):
                delta[pair] -= count
            for pair in itertools.pairwise(merged):
                delta[pair] += count
                if new in pair:
                    where[pair].add(wi)
            words[wi] = merged
        for pair, d in delta.items():
            if d == 0:
                continue
            total = pair_counts[pair] + d
            if total:
                pair_counts[pair] = total
            else:
                del pair_counts[pair]
            if d > 0:
                heapq.heappush(heap, (-total, pair[0], pair[1]))
        progress.update()
    progress.close()
    return merges
