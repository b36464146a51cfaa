"""Rotary position embedding (RoPE) of q and k, HF's "rotate half" layout, with autograd.

Each head vector is split into halves ``(x1, x2)`` and every pair ``(x1_i, x2_i)`` is turned by
the angle ``position · θ^(-2i/D)``: ``(x1 cos - x2 sin, x2 cos + x1 sin)``. This is the layout of
``transformers``' Llama (``rotate_half``), whose checkpoints permute q/k rows so that it equals
Meta's interleaved pairs ``(x_2i, x_2i+1)``; keeping HF's layout makes loading a renaming.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (torch ops, the same arithmetic
as HF's ``apply_rotary_pos_emb``), the Triton launcher :func:`triton_rope` (``_jit/rope.py``: q and
k in one launch, one program per token), and the public op :func:`rope`. The backward is the inverse
rotation (the same kernel with ``sin`` negated); cos and sin get no gradient (they come from
positions).

Shapes: q (B, T, Hq, D) and k (B, T, Hk, D) -- token-major, as the projections produce them,
before the heads are moved forward for attention; cos and sin (B or 1, T, D/2).
"""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    jit_module,
    next_power_of_2,
    use_triton,
)


def reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotate(q), rotate(k))`` with torch ops (autograd by torch).

    Written as ``x · [cos, cos] + roll(x, D/2) · [-sin, sin]``: ``roll`` turns ``(x1, x2)`` into
    ``(x2, x1)``, so this is HF's ``x · cos + rotate_half(x) · sin`` product for product (the
    sign moves from ``x2`` to ``sin``, which is exact), in four full-size ops per tensor instead
    of seven; the (T, D) tables are small.
    """
    half = q.shape[-1] // 2
    cos2 = torch.cat((cos, cos), dim=-1).unsqueeze(2)  # (B|1, T, 1, D): one angle for all heads
    sin2 = torch.cat((-sin, sin), dim=-1).unsqueeze(2)
    return q * cos2 + q.roll(half, -1) * sin2, k * cos2 + k.roll(half, -1) * sin2


def triton_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of contiguous ``q`` and ``k``; ``inverse`` turns by ``-θ`` (backward)."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    half = D // 2
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    jit_module("rope").rope_kernel[(B * T,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        T,
        HQ,
        HK,
        half,
        T * half if cos.shape[0] > 1 else 0,
        SIGN=-1.0 if inverse else 1.0,
        COMPUTE=compute_dtype(q.dtype),
        BLOCK_HQ=next_power_of_2(HQ),
        BLOCK_HK=next_power_of_2(HK),
        BLOCK_D=next_power_of_2(half),
    )
    return q_out, k_out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return triton_rope(q.contiguous(), k.contiguous(), cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = triton_rope(dq.contiguous(), dk.contiguous(), cos, sin, inverse=True)
        return dq, dk, None, None


def _validate(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k)):
        check_float("rope", name, t, FLOAT_DTYPES)
        if t.dim() != 4:
            raise ValueError(f"rope: {name} must be 4-D (B, T, H, D), got {tuple(t.shape)}")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D or k.dtype != q.dtype:
        raise ValueError(
            f"rope: k {tuple(k.shape)} {k.dtype} must agree with q {tuple(q.shape)} {q.dtype} "
            "on B, T, D and dtype"
        )
    if D % 2:
        raise ValueError(f"rope: head dim {D} must be even (dimensions are rotated in pairs)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (T, D // 2):
            raise ValueError(
                f"rope: {name} must have shape (1 or {B}, {T}, {D // 2}), got {tuple(t.shape)}"
            )
        if t.requires_grad:
            raise ValueError(f"rope: {name} must not require grad (angles come from positions)")


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, T, Hq, D) and k (B, T, Hk, D) by cos/sin (B or 1, T, D/2). Autograd for q, k."""
    _validate(q, k, cos, sin)
    if use_triton("rope", q, k, cos, sin):
        return _RoPE.apply(q, k, cos, sin)
    return reference(q, k, cos, sin)
