"""The attention context: how one forward's attention layers find their keys.

Every llmlab model has one ``forward``, used by training, decoding, serving and every parallel
layout. What differs between those callers is only *which keys* a query may see and where new
keys and values are kept, so that is what the call carries (vLLM's ``Attention`` layer with its
per-step metadata, and HF's attention interface, are the models for this):

``model(input_ids, positions=None, attention=ctx, attention_mask=None, logits_to_keep=0)``

where ``ctx`` meets :class:`AttentionContext`:

* ``begin(input_ids, positions, attention_mask) -> positions``: called once, before the first
  layer; returns the new tokens' positions (the context knows how many tokens came before);
* ``attend(layer_idx, q, k, v, window=None) -> out``: called by every attention layer with its
  new queries (B, H, T, D) and keys/values (B, H_kv, T, D) after RoPE; keeps ``k``/``v`` where
  it keeps them, and returns softmax attention over the keys each query may see (B, H, T, D).
  ``window``: the layer's sliding window (a query at ``i`` sees keys ``(i - window, i]``), or
  None. A layer may hand the *same* tensor as ``k`` and ``v`` (multi-head latent attention
  attends over its compressed latent, one key head that is also the value; the output's extra
  columns are the layer's to drop): a context may then keep it once
  (``KVCache(values_are_keys=True)``);
* ``end(num_tokens)``: called once after the last layer (a cache commits the new tokens).

Contexts in this repository: none (training: causal, or document-masked with
``document_ids``, through the layer's own attention op, the one ``config.kernels`` picks and
parallel transforms such as ring attention wrap); :class:`PaddedAttention` (a left-padded batch
with no cache); :class:`llmlab.models.KVCache` (a contiguous cache for ``generate``) and its
:meth:`~llmlab.models.KVCache.static_step` (fixed shapes, for ``torch.compile``); and
``llmlab.serving``'s paged context (block tables over the engine's KV pool). A backend plugs in
by implementing these three methods; the model never changes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch.nn.functional as F
from torch import Tensor

from llmlab.models.masks import attention_bias, default_positions, resolve_positions


@runtime_checkable
class AttentionContext(Protocol):
    def begin(
        self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None
    ) -> Tensor: ...

    def attend(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None
    ) -> Tensor: ...

    def end(self, num_tokens: int) -> None: ...


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention`` with grouped-query heads (H_kv dividing H)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=gqa)  # fmt: skip


class MaskedAttention:
    """Attention over ``past`` earlier keys plus the new ones, under HF's decoding masks: causal,
    left padding hidden (``attention_mask``), a sliding window per layer. Subclasses say where
    earlier keys are (:meth:`store`) and how many there are (``past``)."""

    past = 0

    def begin(
        self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None
    ) -> Tensor:
        self._ids, self._mask = input_ids, attention_mask
        self._biases: dict[int | None, Tensor | None] = {}
        if positions is None:
            positions = default_positions(input_ids, self.past, attention_mask)
        return positions

    def store(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the new keys and values where this context keeps them; return every key and
        value the new queries may look at, the new ones last."""
        return k, v

    def attend(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None
    ) -> Tensor:
        k, v = self.store(layer_idx, k, v)
        past, T = self.past, q.shape[2]
        if window is not None and window >= past + T:
            window = None  # the window reaches every key: plain causal
        if window is None and self._mask is None and (past == 0 or T == 1):
            # a fresh unpadded sequence is plainly causal, and one new token sees every key:
            # neither needs a mask tensor, so the fused kernels stay in use
            return sdpa(q, k, v, causal=past == 0 and T > 1)
        if window not in self._biases:
            self._biases[window] = attention_bias(self._ids, past, self._mask, window)
        return sdpa(q, k, v, self._biases[window])

    def end(self, num_tokens: int) -> None:
        self._ids = self._mask = None
        self._biases = {}


class PaddedAttention(MaskedAttention):
    """No cache, a left-padded batch: what ``generate(use_cache=False)`` feeds (the reference the
    caches are tested against). The model uses it by itself when given an ``attention_mask``
    and no context."""


def resolve_context(
    attention: AttentionContext | None, attention_mask: Tensor | None, document_ids: Tensor | None
) -> AttentionContext | None:
    """The context a forward runs with: the given one; :class:`PaddedAttention` for a padding
    mask without one; None (training's causal attention) otherwise. Document ids are for
    training on packed rows and are refused beside a context or a padding mask (decoding)."""
    if document_ids is not None and (attention is not None or attention_mask is not None):
        raise ValueError(
            "document_ids are for training on packed rows; they cannot be combined with an "
            "attention context (decoding: a KV cache or an attention_mask)"
        )
    if attention is None and attention_mask is not None:
        return PaddedAttention()
    return attention


def start_forward(
    attention: AttentionContext | None,
    input_ids: Tensor,
    positions: Tensor | None,
    attention_mask: Tensor | None,
    document_ids: Tensor | None,
) -> tuple[AttentionContext | None, Tensor, int | None]:
    """What a model's forward does before its first layer: the context it runs with
    (:func:`resolve_context`), begun, the new tokens' positions, and the largest of them where
    the host knows it without reading the device (else None)."""
    attention = resolve_context(attention, attention_mask, document_ids)
    T = input_ids.shape[1]
    if attention is None:
        last = T - 1 if positions is None and document_ids is None else None
        return None, resolve_positions(input_ids, positions, 0, None, document_ids, False), last
    last = (
        getattr(attention, "past", 0) + T - 1
        if positions is None and attention_mask is None
        else None
    )
    return attention, attention.begin(input_ids, positions, attention_mask), last


def keep_logits(x: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """The rows of ``x`` (B, T, C) that go through the LM head: the last ``logits_to_keep`` (all
    for 0), or exactly the positions of a LongTensor (HF's convention)."""
    if isinstance(logits_to_keep, Tensor):
        return x[:, logits_to_keep]
    return x[:, -logits_to_keep:] if logits_to_keep > 0 else x
