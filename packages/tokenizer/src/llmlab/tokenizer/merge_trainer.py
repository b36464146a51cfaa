"""Incremental pair-merge training, shared by every BPE-style trainer (byte-level, end-of-word,
SentencePiece BPE, WordPiece).

The corpus is reduced to *distinct words* (pre-tokenized chunks) with counts, each word a
sequence of symbol ids. One merge replaces every occurrence of the best adjacent pair ``(a, b)``
by a new symbol. Instead of recounting the corpus after each merge:

- ``pair_counts[p]`` holds the count-weighted number of occurrences of pair ``p``;
- the words that contain ``p`` are found among a superset (entries may be stale; each is
  re-checked, in C, before it is touched): the words that held ``p`` initially
  (``merge_bulk.InitialPairs``, arrays) and ``where[p]``, the words in which a merge made ``p``
  (lists: appending is cheaper than a set's add, duplicates are dropped once, when ``p`` merges);
- a max-queue gives the best pair. Its entries are plain ints (``merge_bulk.entry``): a pop
  compares ints instead of tuples, which halved its time. It is *lazy*: an entry whose count no
  longer matches ``pair_counts`` is re-queued with the current count when popped. Only pairs
  containing the new symbol can grow, so only those get a fresh entry after a merge.

Speed: each word is kept as a Python ``str`` with one character per symbol id (``chr`` of the id,
shifted past the surrogate block). A merge of a word is then ``word.replace(ab, n)``, which is
exactly BPE's left-to-right, non-overlapping rule and runs in C; the word's adjacent pairs are the
2-character strings ``map(str.__add__, w, w[1:])``, also produced in C. A pair's 2-character
string compares like the tuple of its ids, so the heap's tie-break is unchanged. A merge that
rewrites ``BULK`` words or more updates the counts on arrays instead (``merge_bulk.merge_many``).

Compiled core: ``_merge_core.c`` is this module's loop (``_train`` and ``_merge_few``) in C, step
for step, built at install time where a C compiler is found. Python still spells the words and
makes the token values (``concat``, reuse of an existing token); the loop calls back once per
merge. Without the extension (or with ``LLMLAB_TOKENIZER_PURE=1``) the Python loop below runs;
both learn the same merges (``tests/tokenizer/test_merge_paths.py``). On the 10 MB benchmark
corpus the C loop takes 0.16 s where this one takes 2.8 s (SentencePiece BPE, vocabulary 8k),
which had kept two families' training below HF's speed.

Tie-break (documented and deterministic): the pair with the highest count wins; among equal
counts, the smaller ``(a, b)`` tuple of ids wins. This is HF ``tokenizers``' BpeTrainer rule, and
with the id layout each trainer chooses (HF's) it reproduces HF's merge list.
"""

from __future__ import annotations

import heapq
import os
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import compress, repeat
from operator import add, ne
from typing import Any, TypeVar

from llmlab.tokenizer.gcpause import paused_gc
from llmlab.tokenizer.merge_bulk import InitialPairs, entry, merge_many, unpack
from llmlab.tokenizer.progress import Progress

try:
    from llmlab.tokenizer import _merge_core
except ImportError:  # pragma: no cover - built without a C compiler: the Python loop runs
    _merge_core = None
if os.environ.get("LLMLAB_TOKENIZER_PURE") == "1":
    _merge_core = None

T = TypeVar("T", bound=Hashable)

_SURROGATES = 0xD800
_SHIFT = 0x800  # size of the surrogate block U+D800..U+DFFF, which str cannot hold alone
MAX_SYMBOLS = 0x110000 - _SHIFT - 1  # the last code point is merge_bulk.SEP
BULK = 30  # a merge rewriting this many words or more is done on arrays (merge_bulk)


def id_char(i: int) -> str:
    """The one-character spelling of symbol id ``i`` (monotonic in ``i``)."""
    return chr(i + _SHIFT) if i >= _SURROGATES else chr(i)


def char_id(c: str) -> int:
    o = ord(c)
    return o - _SHIFT if o >= _SURROGATES else o


def spell(ids: Sequence[int]) -> str:
    """A word of symbol ids as the trainer's string."""
    return "".join(map(id_char, ids))


def train_merges(
    words: list[str],
    counts: list[int],
    tokens: list[T],
    vocab_size: int,
    concat: Callable[[T, T], T],
    min_frequency: int = 0,
    show_progress: bool = False,
) -> list[tuple[int, int]]:
    """Learn merges until ``len(tokens) == vocab_size`` or no pair is frequent enough.

    ``words`` are spelled with :func:`spell` (one character per symbol id) and ``counts`` are
    their frequencies. ``tokens`` (id -> token value) is extended in place with each new token;
    a merge whose result already exists reuses that id (as HF does). Returns the merges as pairs
    of ids, in order.
    """
    if len(tokens) + max(vocab_size - len(tokens), 0) > MAX_SYMBOLS:
        raise ValueError(f"vocab_size={vocab_size} exceeds the {MAX_SYMBOLS} symbols supported")
    if _merge_core is not None:  # the same loop in C: Python makes the token values
        progress = Progress("bpe merges", max(vocab_size - len(tokens), 0), show_progress)
        new_token = _token_maker(tokens, concat, progress)
        merges = _merge_core.train(words, counts, len(tokens), vocab_size, min_frequency, new_token)
        progress.close()
        return merges
    with paused_gc():  # the where-sets are many, long-lived and acyclic (see gcpause)
        return _train(words, counts, tokens, vocab_size, concat, min_frequency, show_progress)


def _token_maker(
    tokens: list[T], concat: Callable[[T, T], T], progress: Progress
) -> Callable[[int, int], int]:
    """The compiled loop's callback: the id of the token merging ids ``a`` and ``b`` make (a new
    one appended to ``tokens``, or the existing token it re-makes, which keeps its id, as HF)."""
    token_ids: dict[T, int] = {t: i for i, t in enumerate(tokens)}

    def new_token(a: int, b: int) -> int:
        value = concat(tokens[a], tokens[b])
        new = token_ids.get(value)
        if new is None:
            new = token_ids[value] = len(tokens)
            tokens.append(value)
        progress.update()
        return new

    return new_token


def _train(
    words: list[str],
    counts: list[int],
    tokens: list[T],
    vocab_size: int,
    concat: Callable[[T, T], T],
    min_frequency: int,
    show_progress: bool,
) -> list[tuple[int, int]]:
    token_ids: dict[T, int] = {t: i for i, t in enumerate(tokens)}
    first = InitialPairs(words, counts)
    weights = first.weights  # None without numpy: every merge is then done one word at a time
    pair_counts = first.counts
    # where[p]: words in which a merge made p (may repeat a word, or name one that lost p since)
    where: defaultdict[str, list[int]] = defaultdict(list)
    initial = sorted(entry(p, c) for p, c in pair_counts.items() if c > 0)
    next_initial = 0
    heap: list[int] = []

    merges: list[tuple[int, int]] = []
    progress = Progress("bpe merges", max(vocab_size - len(token_ids), 0), show_progress)
    while len(tokens) < vocab_size:
        if heap and (next_initial == len(initial) or heap[0] < initial[next_initial]):
            queued, pair = unpack(heapq.heappop(heap))
        elif next_initial < len(initial):
            queued, pair = unpack(initial[next_initial])
            next_initial += 1
        else:
            break
        current = pair_counts.get(pair, 0)
        if queued != current:  # stale entry: re-queue with the true count
            if current > 0:
                heapq.heappush(heap, entry(pair, current))
            continue
        if current < 1 or current < min_frequency:
            break
        a, b = char_id(pair[0]), char_id(pair[1])
        value = concat(tokens[a], tokens[b])
        new = token_ids.get(value)
        reused = new is not None
        if new is None:
            new = len(tokens)
            tokens.append(value)
            token_ids[value] = new
        merges.append((a, b))
        _apply_merge(
            pair, id_char(new), reused, (words, counts, weights), pair_counts, first, where, heap
        )
        progress.update()
    progress.close()
    return merges


def _apply_merge(
    pair: str,
    n: str,
    reused: bool,
    corpus: tuple[list[str], list[int], Any],
    pair_counts: dict[str, int],
    first: InitialPairs,
    where: defaultdict[str, list[int]],
    heap: list[int],
) -> None:
    """Rewrite every word containing ``pair`` (``ab``) and update the pair counts in place.

    A word holds ``pair`` now only if it did initially (``first``) or a merge made it there
    (``where``); those candidates are rewritten in C (``str.replace``), and the hits are the words
    that changed. Their counts are updated on arrays when they are many
    (``merge_bulk.merge_many``), else one by one (``_merge_few``): only the neighbourhood of each
    merge changes: an ``n`` preceded by ``L`` was ``L a`` and is now ``L n`` (``b a`` and ``n n``
    when ``L`` is itself a merge), and an ``n`` followed by ``R`` was ``b R`` and is now
    ``n R``. The pair ``ab`` itself drops to zero. Only pairs containing ``n`` can have grown, so
    only those get heap entries.
    """
    words, counts, weights = corpus  # the counts as a list and as an array
    candidates = first.pop(pair)
    made = where.pop(pair, None)
    if made:
        candidates = list(set(made).union(candidates))
    # Rewrite the candidates in C; those that held the pair are the ones that changed.
    olds = list(map(words.__getitem__, candidates))
    news = list(map(str.replace, olds, repeat(pair), repeat(n)))
    changed = list(map(ne, olds, news))
    hits = list(compress(candidates, changed))
    news = list(compress(news, changed))
    deque(map(words.__setitem__, hits, news), maxlen=0)
    if len(hits) >= BULK and not reused and weights is not None:
        entries = merge_many(pair, n, hits, news, weights, pair_counts, where)
    else:
        olds = list(compress(olds, changed))
        grown = _merge_few(pair, n, reused, hits, olds, news, counts, pair_counts, where)
        entries = [entry(p, pair_counts[p]) for p in grown]
    pair_counts.pop(pair, None)
    for e in entries:
        heapq.heappush(heap, e)


def _merge_few(
    pair: str,
    n: str,
    reused: bool,
    hits: list[int],
    olds: list[str],
    news: list[str],
    counts: list[int],
    pair_counts: dict[str, int],
    where: defaultdict[str, list[int]],
) -> set[str]:
    """``_apply_merge``'s count updates for a few rewritten words (``olds`` -> ``news``), one by
    one; returns the pairs that grew."""
    a, b = pair
    ba, nn = b + a, n + n
    get = pair_counts.get
    grown: set[str] = set()
    for wi, old, new in zip(hits, olds, news):
        count = counts[wi]
        if reused and n in old:  # the merge re-made a token the word holds: recount it all
            for p in map(add, old, old[1:]):
                pair_counts[p] -= count
            for p in map(add, new, new[1:]):
                pair_counts[p] = get(p, 0) + count
                if n in p:
                    where[p].append(wi)
                    grown.add(p)
            continue
        last = len(new) - 1
        j = new.find(n)
        while j >= 0:
            if j > 0:
                left = new[j - 1]
                if left == n:
                    pair_counts[ba] -= count
                    p = nn
                else:
                    pair_counts[left + a] -= count
                    p = left + n
                pair_counts[p] = get(p, 0) + count
                where[p].append(wi)
                grown.add(p)
            if j < last:
                right = new[j + 1]
                if right != n:
                    pair_counts[b + right] -= count
                    p = n + right
                    pair_counts[p] = get(p, 0) + count
                    where[p].append(wi)
                    grown.add(p)
            j = new.find(n, j + 1)
    return grown
