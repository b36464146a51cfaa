"""What every llmlab tokenizer shares: a content fingerprint and saving through ``formats``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


class TokenizerBase:
    """Mixin for BPE, WordPiece and Unigram: each defines ``model`` and ``to_dict()``."""

    model: str

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """A stable hash of everything that decides the ids (for cache keys)."""
        return fingerprint(self)

    def save(self, path: str | Path, format: str = "llmlab") -> Path:
        """Write ``format`` = "llmlab" (readable JSON), "hf" (tokenizer.json) or, for BPE,
        "tiktoken"."""
        from llmlab.tokenizer import formats

        return formats.save(self, path, format)


def fingerprint(tok: Any) -> str:
    """sha1 of the model name and its ``to_dict()`` as canonical JSON, cached on the object."""
    cached = tok.__dict__.get("_fingerprint")
    if cached is None:
        payload = json.dumps({"model": tok.model, **tok.to_dict()}, sort_keys=True)
        cached = hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]
        tok.__dict__["_fingerprint"] = cached
    return cached
