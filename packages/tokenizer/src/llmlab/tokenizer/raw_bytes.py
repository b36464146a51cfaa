"""``ByteTokenizer``: the 256 byte values as tokens (what llmlab's default training runs use).

Nothing to train or to store, no unknown input, lossless for any UTF-8 text. It lives here, not
in the training package, so that anything that reads a checkpoint trained with it (the sampler,
the serving engine) can rebuild it without importing ``llmlab.train``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ByteTokenizer:
    """The 256 byte values as tokens: no training, no unknowns, lossless for any UTF-8 text."""

    vocab_size = 256
    eos_token_id = None
    fingerprint = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(int(i) for i in ids)

    def as_bpe(self) -> Any:
        """The same tokenizer as a byte-level BPE with no merges (ids = byte values), the form
        HF ``tokenizer.json`` can express: what an exported model ships as its tokenizer."""
        from llmlab.tokenizer.bpe import BPETokenizer

        return BPETokenizer({bytes([b]): b for b in range(256)})
