"""Pre-tokenization regexes: text is split into chunks and BPE never merges across chunks.

The named patterns are tiktoken's (``gpt2`` = r50k/p50k/GPT-2, ``gpt4`` = cl100k, ``o200k``).
They use possessive quantifiers, which the ``regex`` module supports like tiktoken's
fancy-regex does. ``compiled`` gives them tiktoken's Unicode classes (``unicode_pin``), so the
reference encoder splits text exactly as tiktoken does.
"""

from __future__ import annotations

from functools import lru_cache

import regex

from llmlab.tokenizer.unicode_pin import compile_pinned

GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# HF's ByteLevel pre-tokenizer (use_regex=True) splits with GPT-2's original pattern.
HF_BYTELEVEL_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

PATTERNS: dict[str, str] = {
    "gpt2": GPT2_PATTERN,
    "gpt4": GPT4_PATTERN,
    "o200k": O200K_PATTERN,
}
ALIASES: dict[str, str] = {
    "r50k": "gpt2",
    "r50k_base": "gpt2",
    "p50k_base": "gpt2",
    "cl100k": "gpt4",
    "cl100k_base": "gpt4",
    "o200k_base": "o200k",
}


def resolve_pattern(pattern: str) -> str:
    """A pattern name (``gpt2``, ``gpt4``, ``o200k`` or an alias) or a regex -> the regex string.

    A string is treated as a name when it is a bare identifier; anything else must compile as a
    regex. An unknown name fails here, with the valid names, before any work starts.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string, got {pattern!r}")
    name = ALIASES.get(pattern, pattern)
    if name in PATTERNS:
        return PATTERNS[name]
    if pattern.isidentifier():
        valid = ", ".join(sorted(PATTERNS) + sorted(ALIASES))
        raise ValueError(
            f"unknown pre-tokenization pattern name {pattern!r}; valid names: {valid} "
            "(or pass a regular expression)"
        )
    try:
        compiled(pattern)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from exc
    return pattern


def pattern_name(pattern: str) -> str | None:
    """The name of a known regex string, or None for a custom one."""
    for name, pat in PATTERNS.items():
        if pat == pattern:
            return name
    return None


@lru_cache(maxsize=32)
def compiled(pattern: str) -> regex.Pattern:
    """``pattern`` compiled with tiktoken's Unicode classes (see ``unicode_pin``)."""
    return compile_pinned(pattern)


_ONIG_INTERVAL_POSSESSIVE = regex.compile(r"(\{\d+(?:,\d*)?\})\+")


def to_onig(pattern: str) -> str:
    """Spell a pattern for HF ``tokenizers`` (Oniguruma), keeping its meaning.

    Oniguruma reads ``x{1,3}+`` as ``(?:x{1,3})+`` (a repeat), not as a possessive interval like
    tiktoken's fancy-regex and Python's ``regex`` do. In llmlab's patterns nothing follows the
    interval inside its alternative, so the greedy ``x{1,3}`` is equivalent and safe.
    """
    return _ONIG_INTERVAL_POSSESSIVE.sub(r"\1", pattern)
