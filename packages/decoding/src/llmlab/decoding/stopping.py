"""When does a row stop? eos ids, stop strings, and the length limit.

Stop strings are matched on the *decoded bytes* of the generated tokens, not on token ids: a
string like ``"\\n\\n"`` may be one token, two tokens, or the end of one token and the start of
the next. A row stops on the token that completes a stop string (that token is kept, as in HF).
Matching bytes rather than text also works when a byte-level BPE token holds only part of a
UTF-8 character. Only generated text is searched: a stop string inside the prompt never stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def token_bytes_fn(tokenizer: Any) -> Any:
    """A cached ``id -> bytes`` for ``tokenizer`` (``decode_bytes`` if it has one, else UTF-8 of
    ``decode``)."""
    cache: dict[int, bytes] = {}

    if hasattr(tokenizer, "decode_bytes"):

        def raw(i: int) -> bytes:
            return bytes(tokenizer.decode_bytes([i]))
    else:

        def raw(i: int) -> bytes:
            return tokenizer.decode([i]).encode("utf-8")

    def get(i: int) -> bytes:
        if i not in cache:
            cache[i] = raw(i)
        return cache[i]

    return get


class StopStrings:
    """Per-row check: does the last token complete one of ``stop_strings``?"""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={list(stop_strings)!r} need a tokenizer to decode tokens: pass "
                f"generate(..., tokenizer=tok) (any object with decode_bytes(ids) or decode(ids))"
            )
        self.stops = [s.encode("utf-8") for s in stop_strings]
        self.longest = max(len(s) for s in self.stops)
        self.token_bytes = token_bytes_fn(tokenizer)

    def row_hits(self, generated: Sequence[int]) -> bool:
        """True when a stop string ends inside the last token of ``generated``."""
        if not generated:
            return False
        last = self.token_bytes(generated[-1])
        if not last:
            return False
        # Enough earlier bytes that a stop string ending in ``last`` fits entirely in ``text``.
        before = b""
        for tok in reversed(generated[:-1]):
            if len(before) >= self.longest - 1:
                break
            before = self.token_bytes(tok) + before
        text = before + last
        start = len(before)
        for stop in self.stops:
            # an occurrence ending after ``start`` uses at least one byte of the last token
            lo = max(0, start - len(stop) + 1)
            if text.find(stop, lo) != -1:
                return True
        return False

    def __call__(self, generated: Tensor) -> Tensor:
        """(N, G) generated ids -> (N,) bool."""
        rows = generated.tolist()
        return torch.tensor([self.row_hits(r) for r in rows], dtype=torch.bool)


class StopCondition:
    """eos ids and stop strings combined: ``(sequences, prompt_len) -> (N,) bool`` for the last
    token of each row."""

    def __init__(
        self, eos_ids: Sequence[int], stop_strings: Sequence[str], tokenizer: Any = None
    ) -> None:
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long) if eos_ids else None
        self.strings = StopStrings(tokenizer, stop_strings) if stop_strings else None

    @property
    def active(self) -> bool:
        return self.eos is not None or self.strings is not None

    def __call__(self, sequences: Tensor, prompt_len: int) -> Tensor:
        last = sequences[:, -1]
        hit = torch.zeros_like(last, dtype=torch.bool)
        if self.eos is not None:
            hit |= torch.isin(last, self.eos.to(last.device))
        if self.strings is not None:
            hit |= self.strings(sequences[:, prompt_len:]).to(last.device)
        return hit
