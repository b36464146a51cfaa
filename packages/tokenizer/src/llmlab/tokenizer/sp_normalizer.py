"""sentencepiece's normalizer (``Normalizer::Normalize``), rule for rule.

1. The text is rewritten by the model's ``precompiled_charsmap`` (longest rule at each position;
   none for the ``identity`` rule), except user-defined symbols, which are copied verbatim.
2. With ``remove_extra_whitespaces``: leading spaces are dropped, a run of spaces becomes one,
   trailing space symbols are dropped. Only U+0020 counts as a space here (after the charsmap,
   which in ``nmt_nfkc`` maps tabs, newlines and the like to it).
3. Spaces become ``▁`` (``escape_whitespaces``) and, with ``add_dummy_prefix``, a ``▁`` is put in
   front of any non-empty result — even one that already starts with ``▁``, unlike HF's
   Metaspace.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import regex

from llmlab.tokenizer.charsmap import Charsmap

SPACE = "▁"
_SPACE_RUN = regex.compile(" {2,}")


class SentencePieceNormalizer:
    """A SentencePiece ``NormalizerSpec``; ``user_defined`` symbols are protected from it."""

    def __init__(
        self,
        add_dummy_prefix: bool = True,
        remove_extra_whitespaces: bool = False,
        escape_whitespaces: bool = True,
        precompiled_charsmap: bytes = b"",
        name: str = "identity",
        user_defined: tuple[str, ...] = (),
    ):
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces
        self.escape_whitespaces = escape_whitespaces
        self.name = name
        self.charsmap = Charsmap(precompiled_charsmap) if precompiled_charsmap else None
        self.user_defined = tuple(user_defined)
        protected = sorted(self.user_defined, key=len, reverse=True)
        self._protected = (
            regex.compile("|".join(regex.escape(s) for s in protected)) if protected else None
        )
        self._plain = self.charsmap is None and not protected and not remove_extra_whitespaces
        self._cache: dict[str, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    # ----------------------------------------------------------------- spec
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "add_dummy_prefix": self.add_dummy_prefix,
            "remove_extra_whitespaces": self.remove_extra_whitespaces,
            "escape_whitespaces": self.escape_whitespaces,
            "precompiled_charsmap": base64.b64encode(self.charsmap.blob).decode("ascii")
            if self.charsmap
            else "",
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], user_defined: tuple[str, ...] = ()
    ) -> SentencePieceNormalizer:
        return cls(
            bool(data.get("add_dummy_prefix", True)),
            bool(data.get("remove_extra_whitespaces", False)),
            bool(data.get("escape_whitespaces", True)),
            base64.b64decode(data.get("precompiled_charsmap") or ""),
            data.get("name", "identity"),
            user_defined,
        )

    # ----------------------------------------------------------------- normalizing
    def __call__(self, text: str) -> str:
        """The normalized text sentencepiece's BPE model sees ("" for blank input)."""
        if len(text) > 256:  # long texts are rarely repeated: not worth a cache entry
            return self._normalize(text)
        out = self._cache.get(text)
        if out is None:
            out = self._normalize(text)
            if len(self._cache) >= 100_000:
                self._cache.clear()
            self._cache[text] = out
        return out

    def normalize_batch(self, texts: Sequence[str]) -> list[str]:
        """``self(text)`` of each text; with the plain rules (identity, spaces kept, no user
        symbols) one list comprehension of ``replace`` and a prefix."""
        if not self._plain or not valid_utf8("".join(texts)):
            return [self(t) for t in texts]
        space = SPACE if self.escape_whitespaces else " "
        prefix = space if self.add_dummy_prefix else ""
        return [prefix + t.replace(" ", space) if t else "" for t in texts]

    def _pieces(self, text: str) -> list[tuple[str, bool]]:
        """The text rewritten piece by piece: (piece, is_raw_run). A raw run is text copied as
        is (sentencepiece handles it one character at a time, which matters only for collapsing
        spaces); a rule's replacement or a user-defined symbol is one piece. Only characters
        whose first byte starts some rule are looked up in the charsmap."""
        # sentencepiece reads bytes: each byte of invalid UTF-8 (a lone surrogate) is U+FFFD
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        out: list[tuple[str, bool]] = []
        for part, is_symbol in split_matches(text, self._protected):
            if is_symbol or self.charsmap is None:
                out.append((part, not is_symbol))
            else:
                out.extend(self._rewrite(part))
        return out

    def _rewrite(self, text: str) -> list[tuple[str, bool]]:
        charsmap = self.charsmap
        assert charsmap is not None
        out: list[tuple[str, bool]] = []
        run_start = pos = 0
        search = charsmap.rule_starts.search
        while (m := search(text, pos)) is not None:
            i = m.start()
            key = text[i : i + 32].encode("utf-8")
            replacement, consumed = charsmap.normalize_sp_prefix(key)
            original = key[:consumed].decode("utf-8")
            if replacement != original:
                if run_start < i:
                    out.append((text[run_start:i], True))
                out.append((replacement, False))
                run_start = i + len(original)
            pos = i + len(original)
        if run_start < len(text):
            out.append((text[run_start:], True))
        return out

    def _normalize(self, text: str) -> str:
        if not text:
            return ""
        if self._plain and valid_utf8(text):
            # identity rule, no user symbols, spaces kept: a prefix and a replace
            space = SPACE if self.escape_whitespaces else " "
            return (
                space + text.replace(" ", space)
                if self.add_dummy_prefix
                else text.replace(" ", space)
            )
        pieces = self._pieces(text)
        remove = self.remove_extra_whitespaces
        if remove:  # leading spaces
            while pieces:
                piece, raw = pieces[0]
                if piece == " " or (raw and not piece.strip(" ")):
                    pieces.pop(0)
                elif raw and piece.startswith(" "):
                    pieces[0] = (piece.lstrip(" "), raw)
                    break
                else:
                    break
            if not pieces:
                return ""
        out = [SPACE if self.escape_whitespaces else " "] if self.add_dummy_prefix else []
        previous_space = remove
        for piece, raw in pieces:
            if previous_space:
                piece = piece.lstrip(" ")
            if raw and remove:
                piece = _SPACE_RUN.sub(" ", piece)
            if piece:
                out.append(piece.replace(" ", SPACE) if self.escape_whitespaces else piece)
                previous_space = piece.endswith(" ")
            if not remove:
                previous_space = False
        result = "".join(out)
        if remove:
            result = result.rstrip(SPACE if self.escape_whitespaces else " ")
        return result


def split_matches(text: str, pattern: regex.Pattern | None) -> list[tuple[str, bool]]:
    """``text`` cut at ``pattern``'s matches: (part, is_match), empty parts left out."""
    if pattern is None:
        return [(text, False)] if text else []
    parts, start = [], 0
    for m in pattern.finditer(text):
        if m.start() > start:
            parts.append((text[start : m.start()], False))
        parts.append((m.group(), True))
        start = m.end()
    if start < len(text):
        parts.append((text[start:], False))
    return parts


def valid_utf8(text: str) -> bool:
    """Whether ``text`` has no lone surrogate (sentencepiece would see invalid UTF-8)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
