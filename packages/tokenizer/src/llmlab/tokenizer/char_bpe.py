"""HF ``tokenizers``' BPE *model* over characters: one word in, ids out.

This is the model behind the end-of-word (Sennrich) and SentencePiece BPE families. A word is
split into characters, each looked up in the vocabulary as HF does: non-initial characters get
``continuing_subword_prefix``, the last one ``end_of_word_suffix``; a character that is not in the
vocabulary becomes its UTF-8 bytes as ``<0xAB>`` tokens (``byte_fallback``), else ``unk_token``
(consecutive unknowns fused into one when ``fuse_unk``), else it is dropped.

Then merges: the adjacent pair with the lowest *rank* is merged, leftmost first among equal ranks,
until no adjacent pair has a rank. ``table`` maps ``(left id, right id) -> (rank, new id)``. From
``tokenizer.json`` the rank is the merge's index in the file; for a SentencePiece model every
split of a piece shares that piece's rank (its place by score), which is SentencePiece's rule:
the pair whose concatenation scores best, leftmost first. The heap check is HF's: a queued
merge still applies when the pair now at its position makes the same new id.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import chain
from typing import Any

from llmlab.tokenizer.bpe_encode import concat_cached
from llmlab.tokenizer.gcpause import paused_gc

Table = dict[tuple[int, int], tuple[float, int]]
CACHE_LIMIT = 200_000


def byte_token(b: int) -> str:
    """The vocabulary spelling of a fallback byte: ``<0x41>``."""
    return f"<0x{b:02X}>"


def merge_all(symbols: list[int], table: Table) -> list[int]:
    """Apply ``table``'s merges to ``symbols`` (ids) in (rank, position) order."""
    n = len(symbols)
    if n < 2:
        return symbols
    get = table.get
    ids = list(symbols)
    nxt = list(range(1, n + 1))  # n: no next symbol
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        hit = get((ids[i], ids[i + 1]))
        if hit is not None:
            heap.append((hit[0], i, hit[1]))
    if not heap:
        return ids
    heapq.heapify(heap)
    while heap:
        _, pos, new = heapq.heappop(heap)
        if not alive[pos]:
            continue
        right = nxt[pos]
        if right >= n:
            continue
        hit = get((ids[pos], ids[right]))
        if hit is None or hit[1] != new:
            continue  # stale: a neighbour merged since this entry was queued
        ids[pos] = new
        alive[right] = False
        after = nxt[right]
        nxt[pos] = after
        if after < n:
            prv[after] = pos
        before = prv[pos]
        if before >= 0:
            hit = get((ids[before], new))
            if hit is not None:
                heapq.heappush(heap, (hit[0], before, hit[1]))
        if after < n:
            hit = get((new, ids[after]))
            if hit is not None:
                heapq.heappush(heap, (hit[0], pos, hit[1]))
    return [ids[i] for i in range(n) if alive[i]]


def merges_table(
    vocab: dict[str, int], merges: Iterable[tuple[str, str]], prefix: str | None
) -> Table:
    """HF's merge map from ``tokenizer.json``: rank = index; the new token is ``a + b`` with
    ``b``'s continuation prefix removed. A later duplicate pair wins, as in HF."""
    cut = len(prefix or "")
    table: Table = {}
    for rank, (a, b) in enumerate(merges):
        for token in (a, b, a + b[cut:]):
            if token not in vocab:
                raise ValueError(f"merge {a!r} {b!r}: token {token!r} is not in the vocabulary")
        table[(vocab[a], vocab[b])] = (rank, vocab[a + b[cut:]])
    return table


class CharBPEModel:
    """Vocabulary + merge table + HF's unknown-character rules; ``tokenize(word)`` is cached."""

    def __init__(
        self,
        vocab: dict[str, int],
        table: Table,
        unk_token: str | None = None,
        fuse_unk: bool = False,
        byte_fallback: bool = False,
        continuing_subword_prefix: str | None = None,
        end_of_word_suffix: str | None = None,
        ignore_merges: bool = False,
    ):
        self.vocab = vocab
        self.table = table
        if unk_token is not None and unk_token not in vocab:
            raise ValueError(f"unk_token {unk_token!r} is not in the vocabulary")
        self.unk_token = unk_token
        self.unk_id = None if unk_token is None else vocab[unk_token]
        self.fuse_unk = fuse_unk
        self.byte_fallback = byte_fallback
        self.prefix = continuing_subword_prefix or ""
        self.suffix = end_of_word_suffix or ""
        self.ignore_merges = ignore_merges
        self.byte_ids: list[int | None] = [vocab.get(byte_token(b)) for b in range(256)]
        self._cache: dict[str, list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def tokenize(self, word: str) -> list[int]:
        """Ids of one pre-tokenized word."""
        return self.encode_words([word])

    def _merge(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        return merge_all(self.symbols(word), self.table)

    def encode_words(self, words: list[str]) -> list[int]:
        """Ids of ``words`` in order (each distinct word merged once, lookups in C)."""
        return concat_cached(words, self._cache, self._merge, CACHE_LIMIT)

    def encode_word_lists(self, lists: list[list[str]]) -> list[list[int]]:
        """``encode_words`` of each list: the unseen words of all lists are merged in one pass,
        then each list is looked up in C (a batch of short texts pays no per-text set)."""
        cache = self._cache
        get = cache.__getitem__
        with paused_gc():  # one new list per text, beside a large cache of lists (gcpause)
            try:  # every word seen before (a warm cache): no pass to find the unseen ones
                return [list(chain.from_iterable(map(get, words))) for words in lists]
            except KeyError:
                pass
            unseen = set().union(*lists).difference(cache)
            if len(cache) + len(unseen) > CACHE_LIMIT:
                return [self.encode_words(words) for words in lists]
            cache.update((word, self._merge(word)) for word in unseen)
            return [list(chain.from_iterable(map(get, words))) for words in lists]

    def symbols(self, word: str) -> list[int]:
        """The word's characters as ids before any merge (HF's ``merge_word`` start)."""
        vocab, prefix, suffix = self.vocab, self.prefix, self.suffix
        out: list[int] = []
        unk_pending = False
        last = len(word) - 1
        for i, c in enumerate(word):
            s = c
            if i and prefix:
                s = prefix + s
            if i == last and suffix:
                s += suffix
            found = vocab.get(s)
            if found is not None:
                if unk_pending:
                    out.append(self.unk_id)  # type: ignore[arg-type]
                    unk_pending = False
                out.append(found)
                continue
            if self.byte_fallback:
                ids = [self.byte_ids[b] for b in s.encode("utf-8")]
                if None not in ids:
                    out.extend(ids)  # type: ignore[arg-type]
                    continue  # (as HF: a pending unknown is emitted after these bytes)
            if self.unk_id is not None:
                if unk_pending and not self.fuse_unk:
                    out.append(self.unk_id)
                unk_pending = True
        if unk_pending:
            out.append(self.unk_id)  # type: ignore[arg-type]
        return out

    def to_hf(self, merges: list[tuple[str, str]], dropout: None = None) -> dict[str, Any]:
        """HF's ``model`` object for ``tokenizer.json``."""
        return {
            "type": "BPE",
            "dropout": dropout,
            "unk_token": self.unk_token,
            "continuing_subword_prefix": self.prefix or None,
            "end_of_word_suffix": self.suffix or None,
            "fuse_unk": self.fuse_unk,
            "byte_fallback": self.byte_fallback,
            "ignore_merges": self.ignore_merges,
            "vocab": dict(sorted(self.vocab.items(), key=lambda kv: kv[1])),
            "merges": [[a, b] for a, b in merges],
        }
