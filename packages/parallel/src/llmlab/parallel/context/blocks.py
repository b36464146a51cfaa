"""Attention of query rows against one key/value block, with its log-sum-exp, and the merge.

Ring attention never holds all keys at once: a rank attends its queries to one key/value chunk
at a time and combines the partial results. Two identities make that exact.

**Merge (forward).** A partial result over key set ``K₁`` is its softmax-normalised output
``O₁`` and its per-row log-sum-exp ``L₁ = log Σ_{j∈K₁} exp(s_j)``. For disjoint ``K₁, K₂``::

    L = log(e^{L₁} + e^{L₂})            O = e^{L₁ − L}·O₁ + e^{L₂ − L}·O₂

is the result over ``K₁ ∪ K₂`` (each ``e^{Lᵢ}`` is the softmax denominator ``Oᵢ`` was divided
by). The flash-attention kernel in ``llmlab.kernels`` applies the same identity tile by tile
inside one rank; here it is applied chunk by chunk across ranks.

**Shares (backward).** With the *final* ``O`` and ``L`` (over all keys),
``P_blk = exp(S_blk − L)`` is exactly that block's slice of the full probabilities, so the
FlashAttention backward run on one block with the final ``O`` and ``L`` yields the block's
share of ``dQ`` (shares sum to ``dQ``) and the complete ``dK``, ``dV`` of its keys from these
queries.

Backends (``BACKENDS``): ``flash`` is PyTorch's fused CPU kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which take and return
the log-sum-exp and index grouped-query heads themselves; ``blocked`` is
:func:`llmlab.parallel.memory.attention_with_lse` (plain torch, any device and dtype: the path a
CUDA run takes). ``auto`` picks ``flash`` for CPU tensors, else ``blocked``. Both work in fp32
(fp64 for fp64 inputs): outputs and gradients are accumulated there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmlab.parallel.memory import (
    accumulation_dtype,
    attention_backward_with_lse,
    attention_with_lse,
)

BACKENDS = ("auto", "flash", "blocked")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``flash`` or ``blocked`` for tensors on ``device``; a clear error for a bad choice."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown ring-attention backend {backend!r}; valid: {list(BACKENDS)}")
    if backend == "auto":
        return "flash" if device.type == "cpu" else "blocked"
    if backend == "flash" and device.type != "cpu":
        raise ValueError(
            f"ring-attention backend 'flash' is PyTorch's CPU kernel; tensors are on {device}: "
            "use backend='blocked' (or 'auto')"
        )
    return backend


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``q`` (B, H, Tq, D) against ``k, v`` (B, H_kv, Tk, D), both in the
    accumulation dtype. ``causal``: the top-left-aligned mask of a diagonal block (Tq == Tk)."""
    acc = accumulation_dtype(q.dtype)
    if backend == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out.to(acc), lse.to(acc)
    return attention_with_lse(q, k, v, causal)


def block_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """This key block's share of ``(dq, dk, dv)`` given the final ``out`` (in q's dtype) and
    ``lse`` (accumulation dtype) of the rows; results in the accumulation dtype, ``dk, dv``
    with the key/value heads (grouped-query heads summed)."""
    acc = accumulation_dtype(q.dtype)
    if backend == "flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal
        )
        return tuple(g.to(acc) for g in grads)  # type: ignore[return-value]
    return attention_backward_with_lse(grad_out, q, k, v, out, lse, causal)


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a partial result ``(block_out, block_lse)`` into ``(out, lse)``, in place.

    ``out`` (…, T, D) and ``lse`` (…, T) start as zeros and ``-inf`` (no keys yet): the first
    merge then copies the block, since ``e^{−∞ − L} = 0``.
    """
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
