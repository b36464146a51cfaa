"""HF ``tokenizers`` normalizers and pre-tokenizers, read from (and written back to)
``tokenizer.json`` and applied with HF's semantics.

The character-level BPE families (end-of-word BPE, SentencePiece BPE loaded from
``tokenizer.json``) keep the file's pipeline as data — the JSON dicts themselves — so that saving
writes back exactly what was loaded, and interpret it here. Supported:

- normalizers: ``Sequence``, ``NFC``/``NFD``/``NFKC``/``NFKD``, ``Lowercase`` (character by
  character, as Rust's ``char::to_lowercase``: no final-sigma rule), ``Strip`` (Rust's
  ``White_Space``), ``Replace`` (string or regex), ``Prepend`` (not on an empty string),
  ``StripAccents``, ``BertNormalizer``, ``Precompiled`` (a SentencePiece charsmap);
- pre-tokenizers: ``Sequence``, ``Whitespace`` (``\\w+|[^\\w\\s]+``), ``WhitespaceSplit``,
  ``BertPreTokenizer``, ``Metaspace`` (replacement, ``prepend_scheme`` always/first/never,
  ``split``), ``Split`` (every ``behavior``, ``invert``), ``ByteLevel``.

Anything else raises ``ValueError`` naming the component, before any text is encoded.
A pre-tokenizer maps ``(pieces, at_start)`` to pieces, where ``at_start`` says whether the first
piece begins at the start of the input (what Metaspace's ``prepend_scheme="first"`` asks).
"""

from __future__ import annotations

import base64
import unicodedata
from collections.abc import Callable
from typing import Any

import regex

from llmlab.tokenizer import bert_text
from llmlab.tokenizer.byte_level import bytes_to_token_string
from llmlab.tokenizer.charsmap import Charsmap
from llmlab.tokenizer.patterns import HF_BYTELEVEL_PATTERN, compiled

Spec = dict[str, Any]
Normalize = Callable[[str], str]
PreTokenize = Callable[[list[str], bool], list[str]]

WHITESPACE = "".join(sorted(bert_text.WHITESPACE))  # Rust's char::is_whitespace
_WS_RUN = regex.compile(r"\s+")  # the regex module's \s is exactly WHITESPACE
_WORDS = compiled(r"\w+|[^\w\s]+")

NORMALIZER_NAMES: dict[str, Spec] = {
    "lowercase": {"type": "Lowercase"},
    "nfc": {"type": "NFC"},
    "nfkc": {"type": "NFKC"},
    "bert": {
        "type": "BertNormalizer",
        "clean_text": True,
        "handle_chinese_chars": True,
        "strip_accents": None,
        "lowercase": True,
    },
}
PRE_TOKENIZER_NAMES: dict[str, Spec] = {
    "whitespace": {"type": "Whitespace"},
    "whitespace_split": {"type": "WhitespaceSplit"},
    "bert": {"type": "BertPreTokenizer"},
}


def resolve(spec: str | Spec | None, names: dict[str, Spec], what: str) -> Spec | None:
    """A component given by name (``names``) or as an HF JSON dict -> the dict."""
    if spec is None or isinstance(spec, dict):
        return spec
    if spec not in names:
        raise ValueError(f"unknown {what} {spec!r}; valid names: {', '.join(names)} (or a dict)")
    return dict(names[spec])


def onig_regex(pattern: str) -> regex.Pattern:
    """An Oniguruma pattern from ``tokenizer.json`` for ``regex`` (``\\z`` becomes ``\\Z``)."""
    return compiled(regex.sub(r"(?<!\\)((?:\\\\)*)\\z", r"\1\\Z", pattern))


def _pattern(spec: Spec) -> regex.Pattern:
    if "String" in spec:
        return regex.compile(regex.escape(spec["String"]))
    if "Regex" in spec:
        return onig_regex(spec["Regex"])
    raise ValueError(f"pattern {spec!r} is neither {{'String': ...}} nor {{'Regex': ...}}")


# ----------------------------------------------------------------------------- normalizers
# A step rewrites the text and, when asked (``align`` not None), says for each output character
# which input character it came from: HF's Metaspace ``prepend_scheme="first"`` adds its ``▁``
# only when the first normalized character still comes from the input's first character (a
# normalizer that deleted leading characters, e.g. stripped spaces, moved the start).
Align = list[int] | None
Step = Callable[[str, Align], tuple[str, Align]]


def normalizer(spec: Spec | None, track: bool = False) -> Callable[[str], tuple[str, bool]]:
    """``text -> (normalized, starts_at_origin)`` for an HF normalizer spec (None: identity);
    ``starts_at_origin`` is computed only when ``track`` (else always True)."""
    steps = _steps(spec)

    def apply(text: str) -> tuple[str, bool]:
        align: Align = list(range(len(text))) if track else None
        for step in steps:
            text, align = step(text, align)
        return text, align is None or (bool(align) and align[0] == 0)

    return apply


def _per_char(fn: Callable[[str], str]) -> Step:
    """A step that rewrites each character on its own (its outputs keep its position)."""

    def step(text: str, align: Align) -> tuple[str, Align]:
        if align is None:
            return fn(text), None
        outs = [fn(c) for c in text]
        return "".join(outs), [a for out, a in zip(outs, align) for _ in out]

    return step


def _whole(fn: Callable[[str], str]) -> Step:
    """A step applied to the whole text (Unicode normalization forms compose across
    characters); positions follow the characters one for one, which keeps the first."""

    def step(text: str, align: Align) -> tuple[str, Align]:
        out = fn(text)
        if align is None or not align:
            return out, align
        return out, [align[min(i, len(align) - 1)] for i in range(len(out))]

    return step


def _steps(spec: Spec | None) -> list[Step]:
    if spec is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        return [step for s in spec["normalizers"] for step in _steps(s)]
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return [_whole(lambda text: unicodedata.normalize(kind, text))]
    if kind == "Lowercase":  # Rust's char::to_lowercase, character by character (no final sigma)
        return [_per_char(str.lower)]
    if kind == "StripAccents":
        return [_per_char(lambda c: "" if unicodedata.category(c) == "Mn" else c)]
    if kind == "Strip":
        return [_strip_step(spec.get("strip_left", True), spec.get("strip_right", True))]
    if kind == "Replace":
        return [_replace_step(_pattern(spec["pattern"]), spec["content"])]
    if kind == "Prepend":
        prefix = spec["prepend"]

        def prepend(text: str, align: Align) -> tuple[str, Align]:
            if not text:
                return text, align
            return prefix + text, None if align is None else [align[0]] * len(prefix) + align

        return [prepend]
    if kind == "BertNormalizer":
        options = (
            spec.get("clean_text", True),
            spec.get("handle_chinese_chars", True),
            spec.get("strip_accents"),
            spec.get("lowercase", True),
        )
        per_char = _per_char(lambda c: bert_text.normalize(c, *options))
        return [lambda text, align: (bert_text.normalize(text, *options), None) if align is None
                else per_char(text, align)]  # fmt: skip
    if kind == "Precompiled":
        charsmap = Charsmap(base64.b64decode(spec["precompiled_charsmap"]))

        def precompiled(text: str, align: Align) -> tuple[str, Align]:
            if align is None:
                return charsmap.normalize_hf(text), None
            parts = charsmap.normalize_hf_parts(text)
            new_align = [align[i] for out, i in parts for _ in out]
            if new_align:  # HF loses a deletion at the very start: position 0 keeps its place
                new_align[0] = min(new_align[0], align[0])
            return "".join(out for out, _ in parts), new_align

        return [precompiled]
    raise ValueError(f"normalizer {kind!r} is not supported")


def _strip_step(left: bool, right: bool) -> Step:
    def step(text: str, align: Align) -> tuple[str, Align]:
        start, end = 0, len(text)
        if left:
            start = len(text) - len(text.lstrip(WHITESPACE))
        if right:
            end = len(text.rstrip(WHITESPACE))
        end = max(start, end)
        return text[start:end], None if align is None else align[start:end]

    return step


def _replace_step(pattern: regex.Pattern, content: str) -> Step:
    def step(text: str, align: Align) -> tuple[str, Align]:
        if align is None:
            return pattern.sub(lambda _: content, text), None
        out, new_align, prev = [], [], 0
        for m in pattern.finditer(text):
            out.append(text[prev : m.start()])
            new_align += align[prev : m.start()]
            out.append(content)
            new_align += [align[m.start()] if m.start() < len(align) else len(text)] * len(content)
            prev = m.end()
        out.append(text[prev:])
        new_align += align[prev:]
        return "".join(out), new_align

    return step


# ----------------------------------------------------------------------------- pre-tokenizers
def pre_tokenizer(spec: Spec | None) -> PreTokenize:
    """The function ``(pieces, at_start) -> pieces`` of an HF pre-tokenizer spec (None: keep)."""
    if spec is None:
        return lambda pieces, at_start: [p for p in pieces if p]
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [pre_tokenizer(s) for s in spec["pretokenizers"]]
        return lambda pieces, at_start: _chain_pre(pieces, at_start, steps)
    if kind == "Whitespace":
        return _each(_WORDS.findall)
    if kind == "WhitespaceSplit":
        return _each(lambda piece: [w for w in _WS_RUN.split(piece) if w])
    if kind == "BertPreTokenizer":
        return _each(bert_text.pre_tokenize)
    if kind == "Metaspace":
        return _metaspace(spec)
    if kind == "Split":
        pattern, behavior = _pattern(spec["pattern"]), spec.get("behavior", "Isolated")
        if behavior not in _BEHAVIORS:
            raise ValueError(f"Split behavior {behavior!r} is not one of {', '.join(_BEHAVIORS)}")
        invert = bool(spec.get("invert", False))
        return _each(lambda piece: split(piece, pattern, behavior, invert))
    if kind == "ByteLevel":
        return _byte_level(spec)
    raise ValueError(f"pre-tokenizer {kind!r} is not supported")


def _chain_pre(pieces: list[str], at_start: bool, steps: list[PreTokenize]) -> list[str]:
    for step in steps:
        pieces = step(pieces, at_start)
    return pieces


def _each(fn: Callable[[str], list[str]]) -> PreTokenize:
    return lambda pieces, at_start: [out for piece in pieces for out in fn(piece) if out]


def _metaspace(spec: Spec) -> PreTokenize:
    replacement = spec.get("replacement", "▁")
    scheme = spec.get("prepend_scheme")
    if scheme is None:  # files older than prepend_scheme
        scheme = "always" if spec.get("add_prefix_space", True) else "never"
    if scheme not in ("always", "first", "never"):
        raise ValueError(f"Metaspace prepend_scheme {scheme!r} is not always, first or never")
    do_split = bool(spec.get("split", True))
    delimiter = regex.compile(regex.escape(replacement))

    def apply(pieces: list[str], at_start: bool) -> list[str]:
        out = []
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            piece = piece.replace(" ", replacement)
            first = at_start and i == 0
            if (scheme == "always" or (scheme == "first" and first)) and not piece.startswith(
                replacement
            ):
                piece = replacement + piece
            out.extend(split(piece, delimiter, "MergedWithNext") if do_split else [piece])
        return [p for p in out if p]

    return apply


def _byte_level(spec: Spec) -> PreTokenize:
    add_prefix_space = bool(spec.get("add_prefix_space", True))
    pattern = compiled(HF_BYTELEVEL_PATTERN) if spec.get("use_regex", True) else None

    def apply(pieces: list[str], at_start: bool) -> list[str]:
        out = []
        for piece in pieces:
            if add_prefix_space and not piece.startswith(" "):
                piece = " " + piece
            parts = split(piece, pattern, "Isolated") if pattern is not None else [piece]
            out.extend(bytes_to_token_string(p.encode("utf-8")) for p in parts if p)
        return out

    return apply


_BEHAVIORS = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def split(text: str, pattern: regex.Pattern, behavior: str, invert: bool = False) -> list[str]:
    """HF's ``NormalizedString::split``: cut ``text`` at ``pattern``'s matches (or at what lies
    between them, ``invert``) and keep, drop or attach the delimiters as ``behavior`` says."""
    spans: list[list[Any]] = []  # [start, end, is_delimiter]
    prev = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if prev != start:
            spans.append([prev, start, invert])
        spans.append([start, end, not invert])
        prev = end
    if prev != len(text):
        spans.append([prev, len(text), invert])
    if behavior == "Removed":
        return [text[s:e] for s, e, delimiter in spans if not delimiter and e > s]
    if behavior == "Isolated":
        return [text[s:e] for s, e, _ in spans if e > s]
    merged: list[list[Any]] = []
    if behavior == "Contiguous":
        previous = False
        for span in spans:
            if merged and span[2] == previous:
                merged[-1][1] = span[1]
            else:
                merged.append(span)
            previous = span[2]
    elif behavior == "MergedWithPrevious":
        previous = False
        for span in spans:
            if span[2] and not previous and merged:
                merged[-1][1] = span[1]
            else:
                merged.append(span)
            previous = span[2]
    else:  # MergedWithNext
        previous = False
        for span in reversed(spans):
            if span[2] and not previous and merged:
                merged[-1][0] = span[0]
            else:
                merged.append(span)
            previous = span[2]
        merged.reverse()
    return [text[s:e] for s, e, _ in merged if e > s]


class Pipeline:
    """A normalizer and a pre-tokenizer, kept as their HF specs (what is saved) and compiled on
    first use (what runs); picklable, so training can count words in worker processes."""

    def __init__(self, normalizer_spec: Spec | None, pre_tokenizer_spec: Spec | None):
        self.normalizer_spec = normalizer_spec
        self.pre_tokenizer_spec = pre_tokenizer_spec
        self._compiled()  # unsupported components fail here, before any text is seen

    @classmethod
    def named(cls, normalizer: str | Spec | None, pre_tokenizer: str | Spec | None) -> Pipeline:
        """A pipeline from names (``NORMALIZER_NAMES``, ``PRE_TOKENIZER_NAMES``) or specs."""
        return cls(
            resolve(normalizer, NORMALIZER_NAMES, "normalizer"),
            resolve(pre_tokenizer, PRE_TOKENIZER_NAMES, "pre-tokenizer"),
        )

    def _compiled(self) -> tuple[Callable[[str], tuple[str, bool]], PreTokenize]:
        fns = self.__dict__.get("_fns")
        if fns is None:
            first = any(
                c.get("type") == "Metaspace" and c.get("prepend_scheme") == "first"
                for c in flatten(self.pre_tokenizer_spec)
            )
            fns = (
                normalizer(self.normalizer_spec, track=first),
                pre_tokenizer(self.pre_tokenizer_spec),
            )
            self.__dict__["_fns"] = fns
        return fns

    def __call__(self, text: str, at_start: bool = True) -> list[str]:
        """The pre-tokenized words of ``text`` (``at_start``: it begins the input)."""
        normalize, pre = self._compiled()
        text, kept_start = normalize(text)
        return pre([text], at_start and kept_start) if text else []  # HF drops "" at once

    def normalize(self, text: str) -> str:
        return self._compiled()[0](text)[0]

    def as_regex(self) -> str | None:
        """A regex whose ``findall`` gives exactly this pipeline's words, when there is one (no
        normalizer, a one-regex pre-tokenizer): counting words for training then runs in C."""
        if self.normalizer_spec is not None or self.pre_tokenizer_spec is None:
            return None
        kind = self.pre_tokenizer_spec.get("type")
        if kind == "Whitespace":
            return _WORDS.pattern
        if kind == "WhitespaceSplit":
            return r"\S+"
        if kind == "BertPreTokenizer":
            return bert_text.WORDS.pattern
        return None

    def has(self, kind: str) -> bool:
        """Whether a component of this type appears anywhere in the pipeline."""
        return any(c.get("type") == kind for c in flatten(self.normalizer_spec)) or any(
            c.get("type") == kind for c in flatten(self.pre_tokenizer_spec)
        )

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_fns"}


def flatten(spec: Any) -> list[Spec]:
    """Every component of a (possibly nested) normalizer or pre-tokenizer spec."""
    if not isinstance(spec, dict):
        return []
    inner = spec.get("normalizers") or spec.get("pretokenizers") or spec.get("decoders") or []
    return [spec] + [c for s in inner for c in flatten(s)]
