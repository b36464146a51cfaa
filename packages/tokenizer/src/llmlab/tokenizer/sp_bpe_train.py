"""Training a SentencePiece BPE model (``model_type=bpe``), laid out as sentencepiece lays one
out, so that the ``.model`` llmlab writes loads in ``sentencepiece`` and encodes identically there.

1. Each text (a sentence; a line of a file) goes through the ``identity`` normalizer: spaces
   become ``▁`` and a dummy ``▁`` is put in front. Words are cut before every ``▁``-run that
   follows other text (sentencepiece's ``allow_whitespace_only_pieces`` split), so pieces never
   contain ``x▁`` and runs of spaces can become pieces (indentation).
2. ``character_coverage``: the most frequent characters covering that share of the text are the
   alphabet; the others are cut out of the words and, at encoding time, fall back to bytes
   (``byte_fallback``) or ``<unk>``.
3. BPE merges as HF's ``BpeTrainer`` (``char_bpe_train``; ties to the smaller ids).
4. Pieces: ``<unk>``, the control tokens, the user-defined symbols, the 256 ``<0x..>`` bytes,
   then the merged pieces in the order they were learned with scores ``0, -1, -2, ...`` (a piece
   learned earlier merges first), then the alphabet by frequency — sentencepiece's layout.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import regex

from llmlab.tokenizer.char_bpe import byte_token
from llmlab.tokenizer.char_bpe_train import char_counts, train_char_bpe
from llmlab.tokenizer.pretokenize import count_chunks
from llmlab.tokenizer.sp_normalizer import SPACE, SentencePieceNormalizer, valid_utf8

Piece = tuple[str, float, str]  # (text, score, kind): normal/unknown/control/user_defined/byte
# Words of normalized text: cut before each "▁"-run that follows other text. (The standard
# ``re`` module: no Unicode class to pin here, and it matches these short lines faster.)
WORDS = re.compile(r"▁*[^▁]+|▁+")


def byte_pieces() -> list[Piece]:
    """The 256 byte-fallback pieces, score 0."""
    return [(byte_token(b), 0.0, "byte") for b in range(256)]


def _simple_line(text: str) -> bool:
    """Whether a line's words are "▁" + its space-separated tokens (``count_units``)."""
    return (
        text[:1] not in ("", " ")
        and text[-1] != " "
        and SPACE not in text
        and "\n" not in text
        and "  " not in text
    )


class SentenceWords:
    """A sentence -> its training words (picklable, for worker processes)."""

    _LINE_WORDS = re.compile(r"▁*[^▁\n]+|▁+")  # WORDS that never cross a "\n"

    def __init__(self, normalizer: SentencePieceNormalizer):
        self.normalizer = normalizer
        n = normalizer
        self.plain = (
            n.charsmap is None
            and not n.user_defined
            and not n.remove_extra_whitespaces
            and n.escape_whitespaces
        )
        self.prefixed = self.plain and n.add_dummy_prefix  # every word starts with "▁"

    def split_batch(self, texts: list[str]) -> list[str]:
        """The words of many sentences. With the plain normalizer (no charsmap, no user symbols,
        spaces kept) normalizing is ``replace`` and a prefix, so the sentences are joined with
        newlines (which no sentence contains) and split by one ``findall``."""
        lines = [t.rstrip("\r\n") for t in texts]
        if not self.plain or any("\n" in t for t in lines) or not valid_utf8("".join(lines)):
            return [w for text in texts for w in self(text)]
        prefix = SPACE if self.normalizer.add_dummy_prefix else ""
        joined = "\n".join(prefix + t.replace(" ", SPACE) for t in lines if t)
        return self._LINE_WORDS.findall(joined)

    def count_units(self, texts: list[str], into: Counter[str]) -> Counter[str]:
        """Count the words of a batch, each without its first "▁" when the words all have one
        (the plain normalizer with the dummy prefix; ``expand`` puts it back once per distinct
        word). Then a line that is not empty, has no "▁", newline or lone surrogate, no space at
        either end and no two spaces in a row has one word per space-separated token: those
        lines are joined by spaces and counted by ``str.split`` and ``Counter`` (in C). The
        other lines go through ``split_batch``."""
        if not self.prefixed:
            into.update(self.split_batch(texts))
            return into
        lines = [t.rstrip("\r\n") for t in texts]
        if not valid_utf8("".join(lines)):
            into.update(w[1:] for w in self.split_batch(lines))
            return into
        flags = list(map(_simple_line, lines))
        simple = list(itertools.compress(lines, flags))
        if len(simple) < len(lines):
            rest = [t for t, f in zip(lines, flags) if t and not f]
            into.update(w[1:] for w in self.split_batch(rest))
        if simple:
            into.update(" ".join(simple).split(" "))
        return into

    def expand(self, units: Counter[str]) -> Counter[str]:
        if not self.prefixed:
            return units
        return Counter({SPACE + u: n for u, n in units.items()})

    def __call__(self, text: str) -> list[str]:
        text = self.normalizer(text.rstrip("\r\n"))
        symbols = self.normalizer.user_defined
        if symbols:  # user-defined symbols are whole pieces already: train on what is between
            text = regex.sub("|".join(map(regex.escape, symbols)), "\0", text)
            return [w for part in text.split("\0") for w in WORDS.findall(part)]
        return WORDS.findall(text)


def train_pieces(
    texts: Iterable[str],
    vocab_size: int,
    normalizer: SentencePieceNormalizer,
    byte_fallback: bool = True,
    character_coverage: float = 0.9995,
    control_tokens: Sequence[str] = ("<s>", "</s>"),
    unk_token: str = "<unk>",
    min_frequency: int = 0,
    workers: int = 1,
    show_progress: bool = False,
) -> list[Piece]:
    """The pieces of a SentencePiece BPE model of ``vocab_size`` pieces (see the module doc)."""
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(f"character_coverage must be in (0, 1], got {character_coverage}")
    meta: list[Piece] = [(unk_token, 0.0, "unknown")]
    meta += [(t, 0.0, "control") for t in control_tokens]
    meta += [(t, 0.0, "user_defined") for t in normalizer.user_defined]
    if byte_fallback:
        meta += byte_pieces()
    names = [p for p, _, _ in meta]
    if len(set(names)) != len(names):
        raise ValueError(f"control, unknown and user-defined pieces must be distinct: {names}")
    words = count_chunks(texts, SentenceWords(normalizer), workers=workers)
    freq = char_counts(words)
    alphabet = _covered(freq, character_coverage)
    kept = _without(words, alphabet)
    freq = freq if kept is words else None  # still the words' character counts?
    words = kept
    needed = len(meta) + len(alphabet)
    if vocab_size < needed:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {len(meta)} reserved pieces and "
            f"{len(alphabet)} characters need at least {needed}"
        )
    tokens, _ = train_char_bpe(
        words,
        vocab_size - len(meta),
        min_frequency=min_frequency,
        show_progress=show_progress,
        char_freq=freq,
    )
    taken = set(names)
    merged = [t for t in tokens if len(t) > 1 and t not in taken]
    pieces = meta + [(t, -float(k), "normal") for k, t in enumerate(merged)]
    start = len(merged)
    pieces += [(c, -float(start + k), "normal") for k, c in enumerate(alphabet)]
    return pieces


def _covered(counts: Counter[str], coverage: float) -> list[str]:
    """The most frequent characters (``counts``: ``char_counts`` of the words) covering
    ``coverage`` of all characters (``▁`` always)."""
    total = sum(counts.values())
    kept, running = [], 0
    for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if kept and running >= coverage * total:
            break
        kept.append(c)
        running += n
    if SPACE in counts and SPACE not in kept:
        kept.append(SPACE)
    return kept


def _without(words: Counter[str], alphabet: list[str]) -> Counter[str]:
    """Words with the characters outside ``alphabet`` cut out (no piece may span them)."""
    allowed = set(alphabet)
    if allowed.issuperset("".join(words)):  # every character kept (checked in C)
        return words
    cut = regex.compile("[^" + "".join(regex.escape(c) for c in sorted(allowed)) + "]+")
    out: Counter[str] = Counter()
    for word, n in words.items():
        for part in cut.split(word):
            if part:
                out[part] += n
    return out
