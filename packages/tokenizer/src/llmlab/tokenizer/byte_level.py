"""GPT-2's reversible byte <-> printable-unicode table.

Byte-level BPE works on raw bytes, but vocab files (GPT-2's ``encoder.json``, HF's
``tokenizer.json``) store tokens as JSON strings. GPT-2 maps every byte to a printable character
(printable Latin-1 bytes map to themselves, the rest to U+0100 onward) so that every token is a
readable string. HF's trainer orders its initial alphabet by these characters' code points, so
that order is also llmlab's byte-id order (see ``hf_byte_order``).
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Byte value -> the printable character GPT-2 uses for it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def bytes_to_token_string(data: bytes) -> str:
    """Bytes -> their GPT-2/HF vocab-file spelling (e.g. b" the" -> "Ġthe")."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in data)


def token_string_to_bytes(token: str) -> bytes:
    """Inverse of :func:`bytes_to_token_string`; raises KeyError on a non byte-level character."""
    table = unicode_to_bytes()
    return bytes(table[c] for c in token)


@lru_cache(maxsize=1)
def hf_byte_order() -> tuple[int, ...]:
    """The 256 byte values sorted by their GPT-2 character's code point (HF's alphabet order)."""
    table = bytes_to_unicode()
    return tuple(sorted(range(256), key=lambda b: ord(table[b])))
