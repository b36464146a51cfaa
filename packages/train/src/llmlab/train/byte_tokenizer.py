"""The byte tokenizer: the 256 byte values as ids, plus an optional end-of-document id.

A module of its own, without torch or Lightning, because ``llmlab.train.prepare`` tokenizes in
worker processes that should start in a fraction of a second (``llmlab.train.data`` re-exports
it for the Shakespeare data module and ``conf/tokenizer/byte.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence

EOS_BYTE_ID = 256


class ByteTokenizer:
    """The 256 byte values as tokens: no training, no unknowns, lossless for any UTF-8 text.

    ``eos=True`` adds id 256, the end-of-document token that prepared datasets append to every
    document (``vocab_size`` 257); decoding drops it, as HF's ``skip_special_tokens`` does.
    """

    vocab_size = 256
    eos_token_id: int | None = None
    fingerprint = "bytes-v1"

    def __init__(self, eos: bool = False) -> None:
        if eos:
            self.vocab_size = EOS_BYTE_ID + 1
            self.eos_token_id = EOS_BYTE_ID
            self.fingerprint = "bytes+eos-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(int(i) for i in ids if int(i) != EOS_BYTE_ID)
