"""SentencePiece's ``precompiled_charsmap``: the normalization rules a ``.model`` carries.

A SentencePiece model stores its normalization (``nmt_nfkc`` by default: NFKC plus NMT-specific
rules) as one binary blob: ``u32 trie size | darts-clone double-array trie (u32 units) |
replacement strings, each NUL-terminated``. The trie maps UTF-8 byte sequences to offsets into
the strings. HF ``tokenizers`` carries the same blob base64-encoded in a ``Precompiled``
normalizer. The two libraries *apply* it differently, and llmlab follows each one for the files
it reads:

- sentencepiece (``normalize_sp_prefix``): at each position take the longest matching rule;
  without a rule, copy one character (an invalid byte becomes U+FFFD).
- HF (``normalize_hf``): split the text into extended grapheme clusters; a cluster shorter than
  6 bytes that *starts with* a rule is replaced whole by the shortest such rule's string;
  otherwise each of its characters is replaced by the rule that starts it, or kept.
"""

from __future__ import annotations

import struct
from functools import cached_property

import regex

_GRAPHEME = regex.compile(r"\X")
MAX_KEY_BYTES = 256  # rule keys are a few characters; this only bounds the search


class Charsmap:
    """A parsed ``precompiled_charsmap`` (``blob`` is kept to write the file back)."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise ValueError("precompiled_charsmap is shorter than its 4-byte header")
        (trie_size,) = struct.unpack_from("<I", blob, 0)
        if trie_size % 4 or 4 + trie_size > len(blob):
            raise ValueError(f"precompiled_charsmap trie size {trie_size} does not fit the blob")
        self.blob = bytes(blob)
        self.units = struct.unpack_from(f"<{trie_size // 4}I", blob, 4)
        self.strings = blob[4 + trie_size :]

    def _root(self) -> int:
        return _offset(self.units[0])

    def _child(self, pos: int, c: int) -> int | None:
        """The node reached from ``pos`` by byte ``c`` (before its offset), or None."""
        pos ^= c
        if pos >= len(self.units) or self.units[pos] & 0x800000FF != c:
            return None
        return pos

    def prefixes(self, key: bytes) -> list[tuple[int, int]]:
        """(length, value) of every rule whose key is a prefix of ``key``, shortest first
        (darts-clone's ``commonPrefixSearch``)."""
        units = self.units
        found = []
        pos = self._root()
        for i, c in enumerate(key):
            if c == 0:
                break
            child = self._child(pos, c)
            if child is None:
                break
            unit = units[child]
            pos = child ^ _offset(unit)
            if (unit >> 8) & 1:
                found.append((i + 1, units[pos] & 0x7FFFFFFF))
        return found

    def replacement(self, value: int) -> str:
        end = self.strings.index(b"\0", value)
        return self.strings[value:end].decode("utf-8")

    @cached_property
    def rule_starts(self) -> regex.Pattern:
        """A character class of the characters whose first UTF-8 byte starts some rule's key;
        text made of other characters is copied as is."""
        ranges = []
        for b in range(1, 256):
            if self._child(self._root(), b) is None:
                continue
            if b < 0x80:
                ranges.append((b, b))
            elif 0xC2 <= b <= 0xDF:
                ranges.append(((b & 0x1F) << 6, ((b & 0x1F) << 6) + 0x3F))
            elif 0xE0 <= b <= 0xEF:
                ranges.append((max((b & 0x0F) << 12, 0x800), ((b & 0x0F) << 12) + 0xFFF))
            elif 0xF0 <= b <= 0xF4:
                ranges.append((max((b & 0x07) << 18, 0x10000), ((b & 0x07) << 18) + 0x3FFFF))
        body = "".join(f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in ranges)
        return regex.compile(f"[{body}]" if body else "(?!)")

    def normalize_sp_prefix(self, data: bytes, pos: int = 0) -> tuple[str, int]:
        """sentencepiece's ``NormalizePrefix`` at ``data[pos:]``: (replacement, bytes consumed).
        Without a rule one character is copied; an invalid byte becomes U+FFFD."""
        found = self.prefixes(data[pos : pos + MAX_KEY_BYTES])
        if found:
            length, value = found[-1]
            return self.replacement(value), length
        first = data[pos]
        width = 1 if first < 0x80 else 2 if first < 0xE0 else 3 if first < 0xF0 else 4
        try:
            return data[pos : pos + width].decode("utf-8"), width
        except UnicodeDecodeError:
            return "\ufffd", 1

    def normalize_hf(self, text: str) -> str:
        """HF ``tokenizers``' ``Precompiled`` normalizer, grapheme by grapheme."""
        return "".join(out for out, _ in self.normalize_hf_parts(text))

    def normalize_hf_parts(self, text: str) -> list[tuple[str, int]]:
        """(output, index in ``text`` of the character it replaces) for each rewritten part."""
        parts = []
        for m in _GRAPHEME.finditer(text):
            grapheme, start = m.group(), m.start()
            encoded = grapheme.encode("utf-8")
            if len(encoded) < 6:
                found = self.prefixes(encoded)
                if found:
                    parts.append((self.replacement(found[0][1]), start))
                    continue
            for k, c in enumerate(grapheme):
                found = self.prefixes(c.encode("utf-8"))
                parts.append((self.replacement(found[0][1]) if found else c, start + k))
        return parts


def _offset(unit: int) -> int:
    """darts-clone's unit offset: 22 bits, scaled by 256 when bit 9 is set."""
    return (unit >> 10) << ((unit & 0x200) >> 6)


def _class_char(code_point: int) -> str:
    return f"\\U{code_point:08x}"
