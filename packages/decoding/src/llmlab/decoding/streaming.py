"""``TextStreamer``: text as tokens arrive, never a broken UTF-8 character.

A byte-level BPE token can hold half of a multi-byte character (an emoji is 4 bytes and may be
split over 2-3 tokens), so decoding token by token would print replacement characters. The
streamer feeds each token's *bytes* into an incremental UTF-8 decoder, which holds an incomplete
character back until its last byte arrives. Tokenizers without ``decode_bytes`` fall back to
decoding the whole sequence and holding back a trailing U+FFFD.

``generate`` calls ``put(ids)`` with the prompt first (skipped by default, as in HF) and then
with each new token, and ``end()`` when done. Read the text by iterating (e.g. from another
thread), through ``on_text``, or from ``streamer.text`` afterwards.
"""

from __future__ import annotations

import codecs
import queue
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

_END = object()


class TextStreamer:
    def __init__(
        self,
        tokenizer: Any,
        skip_prompt: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.on_text = on_text
        self.pieces: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._seen_prompt = False
        self._bytes_mode = hasattr(tokenizer, "decode_bytes")
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # text mode: everything so far
        self._emitted = 0  # text mode: characters already emitted

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def put(self, ids: Tensor | list[int]) -> None:
        """Accept the prompt (first call) or new token ids (a 1-D tensor or list)."""
        flat = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else list(ids)
        if not self._seen_prompt:
            self._seen_prompt = True
            if self.skip_prompt:
                return
        if self._bytes_mode:
            data = bytes(self.tokenizer.decode_bytes(flat)) if flat else b""
            self._emit(self._utf8.decode(data))
        else:
            self._ids.extend(flat)
            text = self.tokenizer.decode(self._ids)
            stable = len(text)
            while stable > self._emitted and text[stable - 1] == "\ufffd":
                stable -= 1  # maybe an incomplete character: wait for more tokens
            self._emit(text[self._emitted : stable])
            self._emitted = max(self._emitted, stable)

    def end(self) -> None:
        """Flush what is held back (an incomplete character becomes U+FFFD) and close."""
        if self._bytes_mode:
            self._emit(self._utf8.decode(b"", final=True))
        else:
            text = self.tokenizer.decode(self._ids) if self._ids else ""
            self._emit(text[self._emitted :])
            self._emitted = len(text)
        self._queue.put(_END)

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        self.pieces.append(piece)
        self._queue.put(piece)
        if self.on_text is not None:
            self.on_text(piece)

    def __iter__(self) -> Iterator[str]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item
