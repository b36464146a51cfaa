"""Rotary position embedding applied to q and k together, forward and backward.

Layout: q (B, T, Hq, D) and k (B, T, Hk, D), contiguous (what the q/k projections produce before
the head transpose), and cos/sin (B or 1, T, D/2). Pairs are HF's "rotate half" ones,
``(x_i, x_{i + D/2})``, each turned by the angle of its frequency ``i``:

    y_i          = x_i * cos_i - x_{i+D/2} * sin_i
    y_{i + D/2}  = x_{i+D/2} * cos_i + x_i * sin_i

One program per token (b, t): cos/sin of that position are loaded once and applied to every
head of q and of k (GQA's k has fewer heads), so the tables are read once instead of once per
tensor and head. A rotation is orthogonal, so the backward is the same kernel turning by ``-θ``
(``SIGN = -1`` negates sin): ``dx = Rᵀ dy``. Nothing is saved but cos and sin.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr, y_ptr, token, H, HALF, cos, sin, COMPUTE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (dims[None, :] < HALF)
    offs = token * H * 2 * HALF + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(COMPUTE)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(y_ptr + offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    T,
    HQ,
    HK,
    HALF,
    cos_batch_stride,  # T * HALF, or 0 when one table serves the whole batch
    SIGN: tl.constexpr,  # 1.0 forward, -1.0 backward (the inverse rotation)
    COMPUTE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    b = token // T
    t = token % T
    dims = tl.arange(0, BLOCK_D)
    table = b * cos_batch_stride + t * HALF + dims
    cos = tl.load(cos_ptr + table, mask=dims < HALF, other=0.0).to(COMPUTE)
    sin = tl.load(sin_ptr + table, mask=dims < HALF, other=0.0).to(COMPUTE) * SIGN
    _rotate(q_ptr, q_out_ptr, token, HQ, HALF, cos, sin, COMPUTE, BLOCK_HQ, BLOCK_D)
    _rotate(k_ptr, k_out_ptr, token, HK, HALF, cos, sin, COMPUTE, BLOCK_HK, BLOCK_D)
