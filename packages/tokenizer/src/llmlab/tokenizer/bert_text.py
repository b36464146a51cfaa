"""BERT's normalizer and pre-tokenizer, character for character as HF ``tokenizers`` does them.

Normalizer: drop NUL/U+FFFD/control characters, turn whitespace into ' ', put spaces around CJK
ideographs, optionally strip accents (NFD, drop combining marks) and lowercase.
Pre-tokenizer: split on whitespace, and isolate every punctuation character (ASCII punctuation
plus Unicode categories P*).
"""

from __future__ import annotations

import unicodedata

_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),  # sic: HF tokenizers starts at 2B920 (BERT's Python had 2B820)
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


# Rust's char::is_whitespace (the White_Space property), which HF uses; Python's str.isspace
# also counts U+001C..U+001F.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
    + "".join(map(chr, range(0x2000, 0x200B)))
)


def _is_whitespace(c: str) -> bool:
    return c in WHITESPACE


def _is_control(c: str) -> bool:
    if c in "\t\n\r":
        return False
    return unicodedata.category(c).startswith("C")


def is_punctuation(c: str) -> bool:
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def normalize(
    text: str,
    clean_text: bool = True,
    handle_chinese_chars: bool = True,
    strip_accents: bool | None = None,
    lowercase: bool = True,
) -> str:
    out = []
    for c in text:
        if clean_text:
            if c in "\x00\ufffd" or _is_control(c):
                continue
            if _is_whitespace(c):
                c = " "
        if handle_chinese_chars and _is_cjk(ord(c)):
            out.extend((" ", c, " "))
        else:
            out.append(c)
    text = "".join(out)
    if strip_accents if strip_accents is not None else lowercase:
        text = "".join(
            c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"
        )
    if lowercase:
        text = text.lower()
    return text


def pre_tokenize(text: str) -> list[str]:
    words: list[str] = []
    current: list[str] = []
    for c in text:
        if c in WHITESPACE:
            if current:
                words.append("".join(current))
                current = []
        elif is_punctuation(c):
            if current:
                words.append("".join(current))
                current = []
            words.append(c)
        else:
            current.append(c)
    if current:
        words.append("".join(current))
    return words
