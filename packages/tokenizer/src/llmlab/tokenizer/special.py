"""tiktoken's special-token semantics, shared by every llmlab tokenizer.

Special tokens are recognised in input text only when allowed; a disallowed special token's text
in the input raises (it would otherwise be silently encoded as ordinary text, a classic prompt
injection). ``allowed_special`` and ``disallowed_special`` accept a set of strings or ``"all"``;
by default nothing is allowed and everything is disallowed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from functools import lru_cache
from typing import Literal

import regex

SpecialSpec = Literal["all"] | Collection[str]


@lru_cache(maxsize=64)
def _alternation(tokens: frozenset[str]) -> regex.Pattern:
    # Longest first so that a special token that prefixes another never shadows it.
    ordered = sorted(tokens, key=lambda t: (-len(t), t))
    return regex.compile("|".join(regex.escape(t) for t in ordered))


def resolve_special(
    specials: Collection[str],
    allowed_special: SpecialSpec,
    disallowed_special: SpecialSpec,
) -> tuple[frozenset[str], frozenset[str]]:
    """(allowed, disallowed) sets, with the same defaults and checks as tiktoken."""
    all_specials = frozenset(specials)
    allowed = all_specials if allowed_special == "all" else frozenset(allowed_special)
    if disallowed_special == "all":
        disallowed = all_specials - allowed
    else:
        disallowed = frozenset(disallowed_special)
    unknown = (allowed | disallowed) - all_specials
    if unknown and allowed_special != "all":
        # tiktoken ignores unknown names silently; naming them is kinder.
        raise ValueError(
            f"unknown special token(s) {sorted(unknown)}; this tokenizer has {sorted(all_specials)}"
        )
    return allowed, disallowed


def check_disallowed(text: str, disallowed: frozenset[str]) -> None:
    if not disallowed:
        return
    match = _alternation(disallowed).search(text)
    if match:
        raise ValueError(
            f"Encountered text corresponding to disallowed special token {match.group()!r}.\n"
            f"If you want this text to be encoded as a special token, pass it to "
            f"`allowed_special`, e.g. `allowed_special={{{match.group()!r}, ...}}`.\n"
            f"If you want this text to be encoded as normal text, disable the check for this "
            f"token by passing `disallowed_special=(enc.special_tokens_set - "
            f"{{{match.group()!r}}})`.\nTo disable this check for all special tokens, pass "
            f"`disallowed_special=()`."
        )


def split_special(text: str, allowed: frozenset[str]) -> Iterator[tuple[str, bool]]:
    """Yield ``(segment, is_special)`` in order; ordinary segments may be empty-free."""
    if not allowed:
        if text:
            yield text, False
        return
    start = 0
    for match in _alternation(allowed).finditer(text):
        if match.start() > start:
            yield text[start : match.start()], False
        yield match.group(), True
        start = match.end()
    if start < len(text):
        yield text[start:], False
