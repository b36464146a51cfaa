"""BERT's normalizer and pre-tokenizer, character for character as HF ``tokenizers`` does them,
written as whole-string regex and ``str`` operations (they run in C: a per-character Python
loop made BERT normalization the slowest step of WordPiece training).

Normalizer: drop NUL, U+FFFD and control characters (categories C*, except tab, newline and
carriage return, which are whitespace), turn whitespace into ' ', put spaces around CJK
ideographs, optionally strip accents (NFD, drop nonspacing marks) and lowercase (character by
character, like Rust's ``char::to_lowercase``: no final-sigma rule).
Pre-tokenizer: split on whitespace, and isolate every punctuation character (ASCII punctuation
plus Unicode categories P*).
"""

from __future__ import annotations

import unicodedata

import regex

_CJK = (
    "\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
    "\U0002b920-\U0002ceaf"  # sic: HF tokenizers starts at 2B920 (BERT's Python had 2B820)
    "\uf900-\ufaff\U0002f800-\U0002fa1f"
)
# Rust's char::is_whitespace (the White_Space property), which HF uses; Python's str.isspace
# also counts U+001C..U+001F.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
    + "".join(map(chr, range(0x2000, 0x200B)))
)
_ASCII_PUNCT = regex.escape("".join(chr(c) for c in range(33, 127) if not chr(c).isalnum()))

# clean_text: tab, newline and carriage return are whitespace, every other C* is dropped
_DROP = regex.compile(r"(?V1)[\x00\ufffd[\p{C}--[\t\n\r]]]+")
_SPACE = regex.compile(r"\s")  # the regex module's \s is exactly WHITESPACE
_CJK_CHAR = regex.compile(f"[{_CJK}]")
_MN = regex.compile(r"\p{Mn}+")
WORDS = regex.compile(rf"[^\s{_ASCII_PUNCT}\p{{P}}]+|[{_ASCII_PUNCT}\p{{P}}]")


# ASCII text needs none of the Unicode work: controls other than tab, newline and carriage
# return are dropped, those three become spaces (one str.translate, in C).
_ASCII_CLEAN = str.maketrans(
    {
        **{chr(c): None for c in (*range(32), 127) if chr(c) not in "\t\n\r"},
        **dict.fromkeys("\t\n\r", " "),
    }
)


def normalize(
    text: str,
    clean_text: bool = True,
    handle_chinese_chars: bool = True,
    strip_accents: bool | None = None,
    lowercase: bool = True,
) -> str:
    if text.isascii():  # no CJK, no accents, no Unicode controls or spaces
        if clean_text:
            text = text.translate(_ASCII_CLEAN)
        return text.lower() if lowercase else text
    if clean_text:
        text = _SPACE.sub(" ", _DROP.sub("", text))
    if handle_chinese_chars:
        text = _CJK_CHAR.sub(r" \g<0> ", text)
    if strip_accents if strip_accents is not None else lowercase:
        text = _MN.sub("", unicodedata.normalize("NFD", text))
    if lowercase:
        # str.lower would turn a word-final "Σ" into "ς"; HF lowers each character alone
        text = text.lower() if "Σ" not in text else "".join(map(str.lower, text))
    return text


def pre_tokenize(text: str) -> list[str]:
    return WORDS.findall(text)
