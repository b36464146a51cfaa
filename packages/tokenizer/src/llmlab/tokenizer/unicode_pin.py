r"""Pin a pattern's Unicode classes to tiktoken's, whatever Unicode the ``regex`` module knows.

Why: a pre-tokenization pattern such as cl100k's ``[^\r\n\p{L}\p{N}]?+\p{L}++`` means what the
regex engine's Unicode tables say. tiktoken's Rust regex knows Unicode 16.0; the ``regex`` module
2026.11 knows 17.0, where 17,144 more code points are ``\p{L}`` (e.g. U+323B0..U+33479), 336 more
are ``\p{N}`` and U+0295 moved from ``Ll`` to ``Lo``. With the module's own classes the reference
encoder split ``"\U000323b0:A"`` as ``["\U000323b0", ":A"]`` where tiktoken splits it as
``["\U000323b0:", "A"]``, and the two encoders disagreed id for id.

How: ``pin(pattern)`` rewrites each ``\p{X}`` / ``\P{X}`` (X one of ``PINNED``) into a version-1
set expression ``[[\p{X}--[extra]]missing]``, where ``extra`` are the code points the installed
``regex`` puts in X and tiktoken does not, and ``missing`` the reverse. Both come from comparing
the module with the committed tables in ``unicode16`` (generated from tiktoken by
``scripts/unicode_tables.py``), once per process, in about 50 ms; so the pin is right for an older
``regex`` (fewer letters) as for a newer one. The engine still tests the property natively and
checks a short exception list, so matching stays nearly as fast as with plain ``\p{X}``
(writing the classes out as ~700 explicit ranges is ~10x slower in the ``regex`` module).

Other properties (``\p{P}``, scripts...) keep the ``regex`` module's meaning; tiktoken's named
patterns use only the pinned ones.
"""

from __future__ import annotations

import array
from functools import cache, lru_cache

import regex

from llmlab.tokenizer.unicode16 import RANGES

PINNED = ("L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "N")
LONG_NAMES = {
    "letter": "L",
    "uppercase_letter": "Lu",
    "lowercase_letter": "Ll",
    "titlecase_letter": "Lt",
    "modifier_letter": "Lm",
    "other_letter": "Lo",
    "mark": "M",
    "combining_mark": "M",
    "number": "N",
}
Range = tuple[int, int]

# A property escape: \p{Name}, \p{^Name}, or \pX (\P for the negation).
_PROPERTY = regex.compile(r"\\([pP])(?:\{(\^?)([^}]*)\}|([A-Za-z]))")
# Inside a version-0 class these are plain characters; version 1 reads "[" as a nested set and
# the doubled ones as set operators, so they are escaped when a pattern is switched to version 1.
_V1_OPERATORS = ("--", "&&", "||", "~~")


def _parse(text: str) -> list[Range]:
    out = []
    for item in text.split():
        first, _, last = item.partition("-")
        out.append((int(first, 16), int(last or first, 16)))
    return out


def _union(*tables: list[Range]) -> list[Range]:
    merged: list[list[int]] = []
    for a, b in sorted(r for table in tables for r in table):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _subtract(left: list[Range], right: list[Range]) -> list[Range]:
    """Code points in ``left`` and not in ``right`` (both sorted, disjoint), as ranges."""
    out = []
    j = 0
    for a, b in left:
        while j < len(right) and right[j][1] < a:
            j += 1
        k, start = j, a
        while k < len(right) and right[k][0] <= b:
            if right[k][0] > start:
                out.append((start, right[k][0] - 1))
            start = max(start, right[k][1] + 1)
            k += 1
        if start <= b:
            out.append((start, b))
    return out


@lru_cache(maxsize=1)
def _every_code_point() -> str:
    # All of U+0000..U+10FFFF in one string (lone surrogates included), so that a match's
    # position *is* its code point. Decoding UTF-32 is ~4x faster than joining chr()s.
    return array.array("I", range(0x110000)).tobytes().decode("utf-32-le", "surrogatepass")


def tiktoken_ranges(name: str) -> list[Range]:
    """tiktoken's ``\\p{name}`` as sorted code-point ranges."""
    if name == "L":
        return _union(*(_parse(RANGES[c]) for c in ("Lu", "Ll", "Lt", "Lm", "Lo")))
    return _parse(RANGES[name])


def regex_ranges(name: str) -> list[Range]:
    """The installed ``regex`` module's ``\\p{name}`` as sorted code-point ranges."""
    return [
        (m.start(), m.end() - 1) for m in regex.finditer(rf"\p{{{name}}}+", _every_code_point())
    ]


@cache
def differences(name: str) -> tuple[list[Range], list[Range]]:
    """(extra, missing): code points the ``regex`` module has in excess / lacks in ``\\p{name}``
    compared with tiktoken."""
    ours, theirs = regex_ranges(name), tiktoken_ranges(name)
    return _subtract(ours, theirs), _subtract(theirs, ours)


def _char(c: int) -> str:
    return f"\\U{c:08x}" if c > 0xFFFF else f"\\u{c:04x}"


def _class_body(ranges: list[Range]) -> str:
    return "".join(_char(a) if a == b else f"{_char(a)}-{_char(b)}" for a, b in ranges)


@cache
def pinned_set(name: str, negated: bool) -> str | None:
    """The version-1 set that means tiktoken's ``\\p{name}`` (``\\P`` when ``negated``), or None
    when the ``regex`` module already agrees.

    ASCII members are spelled out and tested first: the nested set costs a few range checks
    per character, and ASCII is most of most text (this keeps splitting at ~0.9x the speed of
    the bare property on English, ~0.85x on mixed scripts).
    """
    extra, missing = differences(name)
    if not extra and not missing:
        return None
    ascii_members = [(a, min(b, 0x7F)) for a, b in tiktoken_ranges(name) if a <= 0x7F]
    rest = f"[\\p{{{name}}}--[{_class_body(extra)}]]" if extra else f"\\p{{{name}}}"
    members = f"{_class_body(ascii_members)}[\\x80-\\U0010ffff&&[{rest}{_class_body(missing)}]]"
    return f"[{'^' if negated else ''}{members}]"


def _canonical(name: str) -> str | None:
    if name in PINNED:
        return name
    return LONG_NAMES.get(name.lower().replace(" ", "_").replace("-", "_"))


def _property(match: regex.Match) -> str | None:
    kind, caret, braced, single = match.groups()
    name = _canonical(braced if braced is not None else single)
    if name is None:
        return None
    return pinned_set(name, negated=(kind == "P") != (caret == "^"))


def pin(pattern: str) -> tuple[str, bool]:
    """(pattern with tiktoken's classes, whether anything changed). A changed pattern must be
    compiled with ``flags=regex.V1`` (nested sets); see ``compile_pinned``.

    A small scanner, not a substitution: it must know what is escaped (``\\\\p{L}`` is a
    backslash and text) and what is inside a character class (where ``[`` is a literal in
    version 0 and must be escaped for version 1).
    """
    out: list[str] = []
    changed = False
    in_class = False
    class_body_start = 0  # a "]" right after "[" or "[^" is a literal
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            match = _PROPERTY.match(pattern, i)
            pinned = None if match is None else _property(match)
            if pinned is not None:
                out.append(pinned)
                changed = True
                i = match.end()
            else:
                out.append(pattern[i : i + 2])
                i += 2
            continue
        if in_class:
            if ch == "]" and i > class_body_start:
                in_class = False
            elif ch == "[":
                ch = "\\["
            elif pattern[i : i + 2] in _V1_OPERATORS:
                out.append("\\" + ch + "\\" + ch)
                i += 2
                continue
        elif ch == "[":
            in_class = True
            class_body_start = i + (2 if pattern[i + 1 : i + 2] == "^" else 1)
        out.append(ch)
        i += 1
    return ("".join(out), True) if changed else (pattern, False)


def compile_pinned(pattern: str) -> regex.Pattern:
    """Compile ``pattern`` with tiktoken's Unicode classes.

    Version 1 is needed for the nested sets; ``(?-f)`` turns off its full case folding, so
    ``(?i:...)`` keeps the simple folding that version 0, tiktoken and HF use.
    """
    pinned, changed = pin(pattern)
    if not changed:
        return regex.compile(pattern)
    return regex.compile("(?-f)" + pinned, flags=regex.V1)
