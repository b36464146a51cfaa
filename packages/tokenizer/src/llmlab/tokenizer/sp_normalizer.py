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
            regex.compile(b"|".join(regex.escape(s.encode("utf-8")) for s in protected))
            if protected
            else None
        )
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

    def _pieces(self, text: str) -> list[tuple[str, bool]]:
        """The text rewritten piece by piece: (piece, is_raw_run). A raw run is text copied as
        is (sentencepiece handles it one character at a time, which matters only for collapsing
        spaces); a rule's replacement or a user-defined symbol is one piece."""
        data = text.encode("utf-8", "surrogatepass")
        charsmap, protected = self.charsmap, self._protected
        if charsmap is None and protected is None:
            return [(data.decode("utf-8", "replace"), True)]
        starts = charsmap.first_bytes if charsmap is not None else frozenset()
        out: list[tuple[str, bool]] = []
        pos, run_start, end = 0, 0, len(data)

        def flush(upto: int) -> None:
            if run_start < upto:
                out.append((data[run_start:upto].decode("utf-8", "replace"), True))

        while pos < end:
            hit = protected.match(data, pos) if protected is not None else None
            if hit is not None:
                flush(pos)
                out.append((hit.group().decode("utf-8"), False))
                pos = run_start = hit.end()
                continue
            if data[pos] in starts:
                replacement, consumed = charsmap.normalize_sp_prefix(data, pos)  # type: ignore[union-attr]
                if data[pos : pos + consumed] != replacement.encode("utf-8"):
                    flush(pos)
                    out.append((replacement, False))
                    pos = run_start = pos + consumed
                    continue
                pos += consumed
            else:
                pos += _char_width(data[pos])
        flush(end)
        return out

    def _normalize(self, text: str) -> str:
        if not text:
            return ""
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


def _char_width(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
