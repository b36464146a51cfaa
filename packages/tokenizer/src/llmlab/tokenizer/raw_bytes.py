"""``ByteTokenizer``: the 256 byte values as tokens (what llmlab's default training runs use).

Nothing to train or to store, no unknown input, lossless for any UTF-8 text. It lives here, not
in the training package, so that anything that reads a checkpoint trained with it (the sampler,
the serving engine) can rebuild it without importing ``llmlab.train``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EOS_BYTE_ID = 256
EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """The 256 byte values as tokens: no training, no unknowns, lossless for any UTF-8 text.

    ``eos=True`` adds id 256, the end-of-document token that prepared token datasets append to
    every document (``vocab_size`` 257); decoding drops it, as HF's ``skip_special_tokens`` does.
    """

    vocab_size = 256
    eos_token_id: int | None = None
    fingerprint = "bytes-v1"

    def __init__(self, eos: bool = False) -> None:
        self.special_tokens: dict[str, int] = {}
        if eos:
            self.vocab_size = EOS_BYTE_ID + 1
            self.eos_token_id = EOS_BYTE_ID
            self.fingerprint = "bytes+eos-v1"
            self.special_tokens = {EOS_TOKEN: EOS_BYTE_ID}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(int(i) for i in ids if int(i) != EOS_BYTE_ID)

    def as_bpe(self) -> Any:
        """The same tokenizer as a byte-level BPE with no merges (ids = byte values, and the
        end-of-document special when there is one), the form HF ``tokenizer.json`` can express:
        what an exported model ships as its tokenizer."""
        from llmlab.tokenizer.bpe import BPETokenizer

        return BPETokenizer({bytes([b]): b for b in range(256)}, special_tokens=self.special_tokens)
