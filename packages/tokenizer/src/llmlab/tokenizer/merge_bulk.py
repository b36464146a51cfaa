"""The array side of ``merge_trainer``: counting the initial pairs, and applying one merge to many
words at once.

Why: a merge with many words to rewrite cost about 3 µs of interpreted work per word (find each
new symbol, update four pair counts, note the word under each new pair). The merges that touch
30 words or more hold over 90 % of all rewrites on the benchmark corpus, so they are done here
on arrays instead: the rewritten words are joined into one string (a separator, ``SEP``, between
them), read as an array of code points, and every neighbour of the new symbol is found, weighted
and summed by numpy. Interpreted work is then per distinct *pair* changed, not per word.

numpy is optional (the ``fast`` extra; the tokenizer's only required dependency is ``regex``):
without it, ``InitialPairs`` counts in Python and every merge goes through
``merge_trainer._merge_few``. The merges learned are the same either way.

A pair is keyed as ``left << 21 | right`` (code points fit in 21 bits); its name in the trainer's
dictionaries is the 2-character string ``chr(left) + chr(right)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from operator import add
from typing import Any

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised by tests/test_wheels.py's bare environment
    np = None

SEP = "\U0010ffff"  # never a symbol: merge_trainer.MAX_SYMBOLS stops below it
_SEP = ord(SEP)
_BITS = 21
_LOW = (1 << _BITS) - 1
_ENTRY = 2 * _BITS


def entry(pair: str, count: int) -> int:
    """``pair`` with ``count`` as one int that orders as ``(-count, pair)`` does: the merge
    queue's entry (an int compares faster than a tuple, with no pointers to chase)."""
    return (ord(pair[0]) << _BITS | ord(pair[1])) - (count << _ENTRY)


def unpack(e: int) -> tuple[int, str]:
    """(count, pair) of a queue ``entry``."""
    return -(e >> _ENTRY), chr(e >> _BITS & _LOW) + chr(e & _LOW)


def _codes(words: Iterable[str], wide: bool = True) -> Any:
    """The words' characters as code points (int64, or uint32 when not ``wide``), ``SEP``
    before each word and after the last."""
    text = SEP + SEP.join(words) + SEP
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return codes.astype(np.int64) if wide else codes


def _names(keys: Any) -> list[str]:
    return [chr(k >> _BITS) + chr(k & _LOW) for k in keys.tolist()]


def _distinct(values: Any) -> Any:
    """``np.unique(values)`` by sorting (numpy 2's hash-based ``unique`` was 40x slower here)."""
    values = np.sort(values)
    keep = np.empty(len(values), dtype=bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _sum_by_key(keys: Any, weights: Any) -> tuple[Any, list[int], Any]:
    """Distinct keys (sorted), the summed weights of each, and each input's distinct index.

    The sums run in float64, exact for totals below 2**53 (a corpus of that many words)."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    sums = np.bincount(inverse, weights=weights, minlength=len(uniq))
    return uniq, sums.astype(np.int64).tolist(), inverse


def _grouped(group: Any, member: Any, n_groups: int, n_members: int) -> tuple[Any, Any]:
    """For each group, its distinct members: (members sorted by group, group boundaries)."""
    joint = _distinct(group * n_members + member)
    bounds = np.searchsorted(joint // n_members, np.arange(n_groups + 1))
    return joint % n_members, bounds


class InitialPairs:
    """Every adjacent pair of the initial words: its weighted count and the words holding it.

    The word lists are kept as one sorted array with boundaries and handed out (as a list) when a
    pair is merged, so the ~10^5 initial pairs cost no Python container each."""

    def __init__(self, words: list[str], counts: list[int]):
        self.weights: Any = None  # the counts as an int64 array, when numpy is there
        if np is None:
            self._count_in_python(words, counts)
            return
        self.weights = weights = np.asarray(counts, dtype=np.int64)
        arr = _codes(words)
        sep = arr == _SEP
        word_of = np.cumsum(sep) - 1  # a character of word k sits after k + 1 separators
        inner = ~(sep[:-1] | sep[1:])
        keys = (arr[:-1][inner] << _BITS) | arr[1:][inner]
        owner = word_of[:-1][inner]
        uniq, sums, inverse = _sum_by_key(keys, weights[owner].astype(np.float64))
        names = _names(uniq)
        self.counts: dict[str, int] = dict(zip(names, sums))
        self._index = dict(zip(names, range(len(names))))
        self._words, self._bounds = _grouped(inverse, owner, len(uniq), max(len(words), 1))

    def _count_in_python(self, words: list[str], counts: list[int]) -> None:
        pair_counts: defaultdict[str, int] = defaultdict(int)
        holders: defaultdict[str, list[int]] = defaultdict(list)
        for wi, (word, count) in enumerate(zip(words, counts)):
            for pair in map(add, word, word[1:]):
                pair_counts[pair] += count
                held = holders[pair]
                if not held or held[-1] != wi:
                    held.append(wi)
        self.counts = dict(pair_counts)
        self._holders: dict[str, list[int]] | None = dict(holders)

    def pop(self, pair: str) -> list[int]:
        """The (distinct) words that held ``pair`` initially; ``[]`` when asked again."""
        if self.weights is None:
            return self._holders.pop(pair, [])
        i = self._index.pop(pair, None)
        if i is None:
            return []
        return self._words[self._bounds[i] : self._bounds[i + 1]].tolist()


def merge_many(
    pair: str,
    n: str,
    hits: list[int],
    new: list[str],
    counts: Any,
    pair_counts: dict[str, int],
    where: defaultdict[str, list[int]],
) -> list[int]:
    """Update ``pair_counts`` and ``where`` for the words ``hits``, in which ``pair`` was just
    replaced by ``n`` (giving ``new``; ``n`` was in none of them before); returns queue entries
    (``entry``) for the pairs that grew (they contain ``n``).

    The rule is ``merge_trainer._merge_few``'s, on arrays: an ``n`` preceded by ``L`` turns
    ``L a`` into ``L n`` (``b a`` into ``n n`` when ``L`` is ``n``), an ``n`` followed by ``R``
    (not ``n``) turns ``b R`` into ``n R``.
    """
    a, b, c = ord(pair[0]), ord(pair[1]), ord(n)
    arr = _codes(new, wide=False)
    at = np.flatnonzero(arr == c)
    owner = np.searchsorted(np.flatnonzero(arr == _SEP), at) - 1  # separators before, less one
    rows = np.array(hits)
    weight = counts[rows[owner]].astype(np.float64)
    left, right = arr[at - 1].astype(np.int64), arr[at + 1].astype(np.int64)
    has_left = left != _SEP
    has_right = (right != _SEP) & (right != c)
    left, right = left[has_left], right[has_right]
    lost = np.concatenate([(np.where(left == c, b, left) << _BITS) | a, (b << _BITS) | right])
    gained = np.concatenate([(left << _BITS) | c, (c << _BITS) | right])
    owners = np.concatenate([owner[has_left], owner[has_right]])
    weights = np.concatenate([weight[has_left], weight[has_right]])
    uniq, sums, _ = _sum_by_key(lost, weights)
    for p, d in zip(_names(uniq), sums):
        pair_counts[p] -= d
    uniq, sums, inverse = _sum_by_key(gained, weights)
    grown = _names(uniq)
    get = pair_counts.get
    entries = []
    for p, k, d in zip(grown, uniq.tolist(), sums):
        pair_counts[p] = total = get(p, 0) + d
        entries.append(k - (total << _ENTRY))
    members, bounds = _grouped(inverse, owners, len(uniq), len(hits))
    holders, bounds = rows[members].tolist(), bounds.tolist()
    for k, p in enumerate(grown):
        where[p].extend(holders[bounds[k] : bounds[k + 1]])
    return entries
