"""What every llmlab tokenizer shares: tiktoken's special-token handling and a fingerprint.

A model (BPE, WordPiece, Unigram) defines ``encode_ordinary`` (text with no special tokens ->
ids), ``special_tokens`` and ``to_dict``; ``encode`` here cuts the text at the allowed special
tokens and refuses disallowed ones, the same way for all three. Saving and loading live in
``formats`` (``save(tok, path)``, ``load(path)``), which imports the models; nothing here imports
``formats``, so the models never import what imports them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from llmlab.tokenizer.special import SpecialSpec, check_disallowed, resolve_special, split_special


class TokenizerBase:
    """Base of BPE, WordPiece and Unigram: each defines ``model``, ``special_tokens``,
    ``encode_ordinary`` and ``to_dict()``."""

    model: str
    special_tokens: dict[str, int]

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, special-token text encoded as ordinary text."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def encode(
        self,
        text: str,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
    ) -> list[int]:
        """Text -> ids. Special-token text raises unless allowed (tiktoken's semantics)."""
        allowed, disallowed = resolve_special(
            self.special_tokens, allowed_special, disallowed_special
        )
        check_disallowed(text, disallowed)
        out: list[int] = []
        for segment, is_special in split_special(text, allowed):
            if is_special:
                out.append(self.special_tokens[segment])
            else:
                out.extend(self.encode_ordinary(segment))
        return out

    def encode_batch(self, texts: Sequence[str], **kwargs: Any) -> list[list[int]]:
        """``encode`` of each text (``kwargs`` as for ``encode``)."""
        return [self.encode(t, **kwargs) for t in texts]

    @property
    def fingerprint(self) -> str:
        """A stable hash of everything that decides the ids (for cache keys)."""
        return fingerprint(self)


def fingerprint(tok: Any) -> str:
    """sha1 of the model name and its ``to_dict()`` as canonical JSON, cached on the object."""
    cached = tok.__dict__.get("_fingerprint")
    if cached is None:
        payload = json.dumps({"model": tok.model, **tok.to_dict()}, sort_keys=True)
        cached = hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]
        tok.__dict__["_fingerprint"] = cached
    return cached
