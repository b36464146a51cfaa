"""``HFModel``: make a HF ``transformers`` causal LM follow llmlab's decoding contract.

The strategies in this package only need ``model(input_ids, attention=cache, positions=,
attention_mask=, logits_to_keep=) -> logits`` and ``model.new_cache(batch_size, max_len)``.
This adapter provides both around any ``*ForCausalLM``, using HF's own ``DynamicCache`` (wrapped
to expose ``length``, ``reorder`` and ``crop``), and position ids derived from the attention mask
exactly as HF ``generate`` derives them. ``transformers`` is imported lazily, only when a cache
is created, so importing ``llmlab.decoding`` never pulls it in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class HFCache:
    """A HF ``DynamicCache`` seen through llmlab's cache interface."""

    def __init__(self, hf_cache: Any, max_len: int) -> None:
        self.hf_cache = hf_cache
        self.max_len = max_len
        self.length = 0

    def reorder(self, batch_indices: Tensor) -> None:
        if self.length:
            self.hf_cache.reorder_cache(batch_indices)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if length < self.length:
            self.hf_cache.crop(length - self.length)  # HF takes minus the tokens to drop
        self.length = length


class HFModel:
    """Adapter: ``HFModel(GPT2LMHeadModel(...))`` decodes with every llmlab strategy."""

    def __init__(self, hf_model: Any) -> None:
        self.hf_model = hf_model

    @property
    def config(self) -> Any:
        return self.hf_model.config

    def new_cache(self, batch_size: int, max_len: int) -> HFCache:
        from transformers import DynamicCache

        limit = getattr(self.hf_model.config, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(f"max_len={max_len} exceeds the model's {limit} positions")
        return HFCache(DynamicCache(config=self.hf_model.config), max_len)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        attention: HFCache | None = None,
        attention_mask: Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> Tensor:
        cache = attention
        past = cache.length if cache is not None else 0
        T = input_ids.shape[1]
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(past, past + T, device=input_ids.device)[None]
            else:  # as HF generate: cumulative count of real tokens; padding gets position 1
                positions = attention_mask.long().cumsum(-1) - 1
                positions = positions.masked_fill(attention_mask == 0, 1)[:, past : past + T]
        out = self.hf_model(
            input_ids=input_ids,
            cache=cache.hf_cache if cache is not None else None,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
        )
        if cache is not None:
            cache.length += T
        return out.logits

    __call__ = forward
