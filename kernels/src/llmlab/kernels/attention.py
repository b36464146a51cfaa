"""Flash-style attention with autograd, usable as the GPT's attention.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (the textbook ``softmax(q k^T *
scale + mask) v``, which materialises the T x T matrix), :func:`triton_forward` /
:func:`triton_backward` (the kernels in ``_jit/attention.py``: online softmax forward saving
log-sum-exp, FlashAttention-2 backward that recomputes probabilities), and the public
:func:`attention`, whose semantics are those of ``F.scaled_dot_product_attention(q, k, v,
is_causal=causal, scale=scale, enable_gqa=True)`` for q (B, H, L, D) and k, v (B, H_kv, S, D), where
``H_kv`` divides ``H``: grouped-query attention (Llama, Mistral) reads each KV head for ``H / H_kv``
query heads by index, without repeating K and V in memory (``H_kv == H`` is ordinary multi-head
attention).

Document masking: ``document_ids`` (B, T), non-decreasing along each row, restricts a query to
the keys of its own document (causal inside it): block-diagonal attention over a packed row, as
Llama 3 and torchtitan train. The kernels read it as each token's document start and end, and
skip the tiles outside the diagonal blocks.

Memory: the forward keeps O(T) extra floats per head (the lse) instead of the O(T^2)
probabilities an eager implementation saves for backward; that is the seed's "attention
backward memory reuse".
"""

from __future__ import annotations

import math

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    dot_in_fp32,
    dot_precision,
    interpreter_requested,
    jit_module,
    next_power_of_2,
    use_triton,
)

MAX_HEAD_DIM = 256


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: key ``j`` is visible to query ``i`` iff ``j <= i``, same document."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of each token's document, both (B, T) int32: the interval the kernels mask
    with (documents are contiguous runs of equal ids)."""
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    first = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(first, idx, 0).cummax(dim=1).values
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    # the end of a run, read backwards: the smallest "last index + 1" at or after each token
    end = torch.where(last, idx + 1, T).flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention, computed in fp32 (fp64 for fp64) and cast back. The oracle repeats
    GQA's K/V heads explicitly (what the kernel avoids)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if causal:
        L, S = s.shape[-2:]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    if document_ids is not None:
        s = s.masked_fill(~document_mask(document_ids), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.to(acc)).to(q.dtype)


def _blocks(device: torch.device, D: int) -> tuple[int, int]:
    if device.type == "cuda":
        return (64, 64) if D <= 128 else (32, 32)
    return (16, 16) if interpreter_requested() else (32, 32)


def triton_forward(
    q, k, v, causal: bool, scale: float, autotune: bool | None = None, starts=None, heads: int = 1
):
    """``(o, lse)`` for contiguous (B·H, L, D) q and (B·H_kv, S, D) k, v; ``starts``: the
    (B, L) int32 document starts of :func:`document_bounds` (``heads`` = H), or None."""
    BH, L, D = q.shape
    S = k.shape[1]
    group = BH // k.shape[0]
    o = torch.empty_like(q)
    lse = torch.empty(
        (BH, L), device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32
    )
    jit = jit_module("attention")
    docs = starts is not None
    args = (q, k, v, o, lse, scale, L, S, D, group, starts if docs else lse, heads)
    flags = {
        "CAUSAL": causal,
        "DOCS": docs,
        "COMPUTE": compute_dtype(q.dtype),
        "DOT_IN_FP32": dot_in_fp32(q.dtype),
        "PRECISION": dot_precision(q),
        "BLOCK_D": max(16, next_power_of_2(D)),
    }
    if autotune is None:
        autotune = q.is_cuda
    if autotune:
        import triton

        def grid(meta):
            return (triton.cdiv(L, meta["BLOCK_M"]), BH)

        jit.attn_fwd_kernel_autotuned[grid](*args, **flags)
    else:
        bm, bn = _blocks(q.device, D)
        jit.attn_fwd_kernel[((L + bm - 1) // bm, BH)](*args, **flags, BLOCK_M=bm, BLOCK_N=bn)
    return o, lse


def triton_backward(do, q, k, v, o, lse, causal: bool, scale: float, bounds=None, heads: int = 1):
    """``(dq, dk, dv)``; ``delta = rowsum(dO * O)`` is computed by torch first. ``bounds``: the
    ``(starts, ends)`` of :func:`document_bounds`, or None."""
    BH, L, D = q.shape
    BH_kv, S = k.shape[:2]
    group = BH // BH_kv
    do = do.contiguous()
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    jit = jit_module("attention")
    starts, ends = bounds if bounds is not None else (lse, lse)
    flags = {
        "CAUSAL": causal,
        "DOCS": bounds is not None,
        "COMPUTE": compute_dtype(q.dtype),
        "DOT_IN_FP32": dot_in_fp32(q.dtype),
        "PRECISION": dot_precision(q),
        "BLOCK_D": max(16, next_power_of_2(D)),
    }
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, scale, L, S, D, group, ends, heads)
    dq_args = (q, k, v, do, lse, delta, dq, scale, L, S, D, group, starts, heads)
    if q.is_cuda:  # each kernel writes its outputs whole, so the autotuner may rerun it
        import triton

        jit.attn_bwd_dkdv_kernel_autotuned[lambda m: (triton.cdiv(S, m["BLOCK_N"]), BH_kv)](
            *dkdv_args, **flags
        )
        jit.attn_bwd_dq_kernel_autotuned[lambda m: (triton.cdiv(L, m["BLOCK_M"]), BH)](
            *dq_args, **flags
        )
    else:
        bm, bn = _blocks(q.device, D)
        flags.update(BLOCK_M=bm, BLOCK_N=bn)
        jit.attn_bwd_dkdv_kernel[((S + bn - 1) // bn, BH_kv)](*dkdv_args, **flags)
        jit.attn_bwd_dq_kernel[((L + bm - 1) // bm, BH)](*dq_args, **flags)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, document_ids):
        B, H, L, D = q.shape
        H_kv, S = k.shape[1:3]
        q3 = q.reshape(B * H, L, D).contiguous()
        k3 = k.reshape(B * H_kv, S, D).contiguous()
        v3 = v.reshape(B * H_kv, S, D).contiguous()
        bounds = document_bounds(document_ids) if document_ids is not None else None
        starts = bounds[0] if bounds is not None else None
        o, lse = triton_forward(q3, k3, v3, causal, scale, starts=starts, heads=H)
        ctx.save_for_backward(q3, k3, v3, o, lse, *(bounds or ()))
        ctx.causal, ctx.scale, ctx.shapes = causal, scale, (q.shape, k.shape)
        return o.reshape(B, H, L, D)

    @staticmethod
    def backward(ctx, do):
        q3, k3, v3, o, lse, *bounds = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        dq, dk, dv = triton_backward(
            do.reshape(o.shape), q3, k3, v3, o, lse, ctx.causal, ctx.scale,
            bounds=tuple(bounds) or None, heads=q_shape[1],
        )  # fmt: skip
        return dq.reshape(q_shape), dk.reshape(k_shape), dv.reshape(k_shape), None, None, None


def _validate_documents(q, k, causal, document_ids):
    if document_ids is None:
        return
    B, _, L, _ = q.shape
    if not causal or k.shape[2] != L:
        raise ValueError(
            "attention: document_ids mask causal self-attention only (causal=True and as many "
            f"keys as queries); got causal={causal}, {L} queries and {k.shape[2]} keys"
        )
    if tuple(document_ids.shape) != (B, L) or document_ids.dtype.is_floating_point:
        raise ValueError(
            f"attention: document_ids must be integer ids of shape (B, T) = ({B}, {L}), got "
            f"{document_ids.dtype} of shape {tuple(document_ids.shape)}"
        )


def _validate(q, k, v, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float("attention", name, t, FLOAT_DTYPES)
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D (B, H, T, D), got shape {tuple(t.shape)}"
            )
        if t.dtype != q.dtype:
            raise TypeError(f"attention: {name} is {t.dtype} but q is {q.dtype}; they must match")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must match")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B and D, and "
            f"k's {k.shape[1]} heads must divide q's {q.shape[1]} (grouped-query attention)"
        )
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim {q.shape[3]} exceeds the {MAX_HEAD_DIM} supported")
    if scale is not None and not scale > 0:
        raise ValueError(f"attention: scale must be > 0 or None, got {scale!r}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` for
    q (B, H, L, D), k and v (B, H_kv, S, D) with ``H_kv`` dividing ``H`` (GQA when smaller);
    ``scale`` defaults to ``1 / sqrt(D)``. ``document_ids`` (B, T), non-decreasing per row:
    each query sees only the earlier keys of its own document (with ``causal=True``). Autograd."""
    _validate(q, k, v, scale)
    _validate_documents(q, k, causal, document_ids)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton("attention", q, k, v):
        return _FlashAttention.apply(q, k, v, causal, scale, document_ids)
    gqa = q.shape[1] != k.shape[1]
    if document_ids is not None:
        mask = document_mask(document_ids)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
    )
