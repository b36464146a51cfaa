"""``ModelRunner``: feeds new tokens to a decodable model, with or without its KV cache.

The decoding contract (DESIGN §3) is ``model(input_ids, cache=, positions=, attention_mask=)``
plus ``model.new_cache(batch_size, max_len)``; the cache has ``length``, ``reorder(indices)`` and
``crop(length)``. Every strategy talks to the model only through this class, so each works on
any model honouring the contract, cached or not:

* cached: the prompt is prefilled once, then only the new tokens go through the model;
* uncached: the whole sequence is recomputed at every call (the reference the cache is tested
  against).

The runner also keeps the running attention mask (left padding), extending it by ones as tokens
arrive; a batch without padding passes no mask at all, so the model keeps its fused causal path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class ModelRunner:
    """Incremental forward passes over a batch of ``batch_size`` rows of at most ``max_len``."""

    def __init__(
        self,
        model: Any,
        batch_size: int,
        max_len: int,
        use_cache: bool = True,
        attention_mask: Tensor | None = None,
    ) -> None:
        self.model = model
        self.use_cache = use_cache
        self.cache = model.new_cache(batch_size, max_len) if use_cache else None
        forward = getattr(model, "forward", model)
        self._keep_logits = _accepts(forward, "logits_to_keep")
        if attention_mask is not None and bool(attention_mask.bool().all()):
            attention_mask = None  # no padding: the plain causal path is exact and faster
        self.mask = attention_mask.long() if attention_mask is not None else None
        self.tokens: Tensor | None = None  # the full sequence, only kept when uncached
        self.length = 0

    def feed(self, new_ids: Tensor, keep: int = 1) -> Tensor:
        """Run ``new_ids`` (N, T); return float32 logits (N, keep, V) of the last ``keep`` tokens.

        The mask given at construction covers the first call's tokens; later tokens are real.
        """
        T = new_ids.shape[1]
        if self.mask is not None and self.mask.shape[1] < self.length + T:
            pad = self.mask.new_ones(self.mask.shape[0], self.length + T - self.mask.shape[1])
            self.mask = torch.cat([self.mask, pad], dim=1)
        mask = self.mask[:, : self.length + T] if self.mask is not None else None
        kwargs: dict[str, Any] = {"attention_mask": mask}
        if self._keep_logits:
            kwargs["logits_to_keep"] = keep
        if self.use_cache:
            logits = self.model(new_ids, cache=self.cache, **kwargs)
        else:
            self.tokens = new_ids if self.tokens is None else torch.cat([self.tokens, new_ids], 1)
            logits = self.model(self.tokens, **kwargs)
        self.length += T
        return logits[:, -keep:].float()

    def reorder(self, rows: Tensor) -> None:
        """Keep (or repeat) rows ``rows`` of the batch, e.g. the parents of the surviving beams."""
        if self.cache is not None:
            self.cache.reorder(rows)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, rows)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, rows)

    def crop(self, length: int) -> None:
        """Forget everything after ``length`` tokens (speculative decoding's rejected drafts)."""
        if self.cache is not None:
            self.cache.crop(length)
        if self.tokens is not None:
            self.tokens = self.tokens[:, :length]
        self.length = length
