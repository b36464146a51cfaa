"""BPE training over characters, step for step as HF's ``BpeTrainer`` (which ``WordPieceTrainer``
wraps): the trainer of the end-of-word, SentencePiece-BPE and WordPiece families.

Id layout, as HF builds it: the special tokens; the alphabet (every character of the corpus,
or the ``limit_alphabet`` most frequent plus ``initial_alphabet``) sorted by code point; the
forms the words need beyond the bare characters — ``##c`` for a non-initial character with a
``continuing_subword_prefix``, ``c</w>`` for a final one with an ``end_of_word_suffix``; then one
id per merge (``merge_trainer``: highest count first, ties to the smaller id pair).

The one freedom: HF orders those prefixed/suffixed forms by iterating a hash map whose seed is
random per process, so two HF runs on the same corpus number them differently — and, since ties
between equal counts go to the smaller ids, can learn different merges late in training. llmlab
sorts them (by string). ``initial_tokens`` replaces the whole initial layout after the special
tokens; passing the one an HF-trained vocabulary used reproduces that run exactly, id for id.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from llmlab.tokenizer.merge_trainer import id_char, train_merges


def train_char_bpe(
    word_counts: Mapping[str, int],
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    continuing_subword_prefix: str | None = None,
    end_of_word_suffix: str | None = None,
    limit_alphabet: int | None = None,
    initial_alphabet: Iterable[str] = (),
    initial_tokens: Sequence[str] | None = None,
    min_frequency: int = 0,
    show_progress: bool = False,
    char_freq: Counter[str] | None = None,
) -> tuple[list[str], list[tuple[int, int]]]:
    """(tokens in id order, merges as id pairs) learned from ``{word: count}``. ``char_freq``:
    ``char_counts(word_counts)`` when the caller has it already (it costs a pass over the words)."""
    prefix, suffix = continuing_subword_prefix or "", end_of_word_suffix or ""
    tokens: list[str] = list(dict.fromkeys(special_tokens))
    if char_freq is None:
        char_freq = char_counts(word_counts)
    alphabet = _alphabet(char_freq, limit_alphabet, initial_alphabet)
    known = set(tokens) | set(alphabet)  # HF keeps a character when its string is a token

    def form(c: str, position: str) -> str:
        """A character's token by its place in the word (HF's is_first / is_last)."""
        return {"first": c, "middle": prefix + c, "last": prefix + c + suffix,
                "alone": c + suffix}[position]  # fmt: skip

    seen = _positions(list(word_counts))
    forms = {form(c, where) for where, chars in seen.items() for c in chars if c in known}
    layout = sorted(alphabet) + sorted(forms - known)
    if initial_tokens is not None:
        _check_layout(list(initial_tokens), layout)
        layout = list(initial_tokens)
    tokens += [t for t in layout if t not in tokens]
    if vocab_size < len(tokens):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {len(special_tokens)} special tokens and the "
            f"{len(tokens) - len(special_tokens)} initial characters need at least {len(tokens)}"
        )
    ids = {t: i for i, t in enumerate(tokens)}
    # Spelling a word is str.translate by position (in C); characters outside the alphabet
    # are dropped, keeping the others' places, as HF does.
    table = {}
    for where, chars in seen.items():
        mapping: dict[str, str | None] = dict.fromkeys(char_freq.keys() - known)
        mapping.update({c: id_char(ids[form(c, where)]) for c in chars & known})
        table[where] = str.maketrans(mapping)
    first, middle, last, alone = (table[k] for k in ("first", "middle", "last", "alone"))
    if prefix or suffix:
        words = [
            w.translate(alone)
            if len(w) == 1
            else w[0].translate(first) + w[1:-1].translate(middle) + w[-1].translate(last)
            for w in word_counts
        ]
    else:  # a character is spelled alike wherever it stands: one translate per word
        anywhere = {**first, **middle, **last, **alone}
        words = [w.translate(anywhere) for w in word_counts]

    cut = len(prefix)

    def concat(a: str, b: str) -> str:
        return a + (b[cut:] if cut and b.startswith(prefix) else b)

    merges = train_merges(
        words, list(word_counts.values()), tokens, vocab_size, concat, min_frequency, show_progress
    )
    return tokens, merges


def char_counts(word_counts: Mapping[str, int]) -> Counter[str]:
    """How often each character occurs, counted in C: words are grouped by their count."""
    groups: dict[int, list[str]] = defaultdict(list)
    for word, n in word_counts.items():
        groups[n].append(word)
    counts: Counter[str] = Counter()
    for n, group in groups.items():
        for c, k in Counter("".join(group)).items():
            counts[c] += k * n
    return counts


def _positions(words: list[str]) -> dict[str, set[str]]:
    """The characters seen first, inside, last and alone in the words."""
    longer = [w for w in words if len(w) > 1]
    return {
        "first": {w[0] for w in longer},
        "middle": set("".join(w[1:-1] for w in longer)),
        "last": {w[-1] for w in longer},
        "alone": {w for w in words if len(w) == 1},
    }


def _alphabet(counts: Counter[str], limit: int | None, initial: Iterable[str]) -> list[str]:
    counts = Counter(counts)
    for c in initial:
        if len(c) != 1:
            raise ValueError(f"initial_alphabet entries must be single characters, got {c!r}")
        counts[c] = sys.maxsize
    if limit is not None and len(counts) > limit:
        # HF drops the least frequent; among equal counts its (unstable) sort picks any of
        # them, llmlab drops the largest code points first.
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        counts = Counter(dict(ranked[:limit]))
    return sorted(counts)


def _check_layout(given: list[str], expected: list[str]) -> None:
    if sorted(given) != sorted(expected) or len(set(given)) != len(given):
        missing = sorted(set(expected) - set(given))[:5]
        extra = sorted(set(given) - set(expected))[:5]
        raise ValueError(
            "initial_tokens must be exactly the alphabet and its prefixed/suffixed forms this "
            f"corpus needs ({len(expected)} tokens), each once; missing e.g. {missing}, "
            f"unexpected e.g. {extra}"
        )
