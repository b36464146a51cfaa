"""A sequence's output text as its tokens arrive: never a broken character, never a stop string.

Two things may not be shown yet when a token arrives, and both are held back rather than
retracted later:

* half a UTF-8 character (a byte-level token can end inside an emoji): ``llmlab.decoding``'s
  ``TextStreamer`` feeds token bytes through an incremental UTF-8 decoder;
* the start of a stop string: as in OpenAI's API, the returned text ends *before* a stop
  string, so a tail of the text that could still grow into one waits for the next token.

So the text streamed piece by piece always equals the final text, and the final text is the
decoded output cut at its first stop string (the eos token, a special token, is not rendered).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmlab.decoding import TextStreamer


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class IncrementalText:
    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.streamer = TextStreamer(tokenizer, skip_prompt=False)
        self.stops = list(stop_strings)
        self.text = ""  # what has been released so far
        self._done = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new tokens (``final``: they are the last); return the newly released text."""
        if self._done:
            return ""
        if token_ids:
            self.streamer.put(token_ids)
        if final:
            self.streamer.end()
            self._done = True
        full = self.streamer.text
        cuts = [i for i in (full.find(s) for s in self.stops) if i >= 0]
        if cuts:
            full = full[: min(cuts)]
        elif not final:
            full = full[: len(full) - held_back(full, self.stops)]
        delta = full[len(self.text) :]
        self.text = full
        return delta
