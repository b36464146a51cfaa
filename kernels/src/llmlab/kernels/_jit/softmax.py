"""Row softmax with an optional causal mask, forward and backward, one program per row.

Forward: ``y = exp(x - max) / sum(exp(x - max))`` over the unmasked columns (subtracting the
row max keeps ``exp`` from overflowing). The causal mask keeps column ``j <= i`` of row ``i`` of
each trailing (L, S) matrix (top-left aligned, as ``scaled_dot_product_attention``'s
``is_causal``). Backward: ``dx = y * (dy - sum(dy * y))``; masked columns have ``y = 0`` and so
get no gradient.
"""

import triton
import triton.language as tl


@triton.jit
def softmax_fwd_kernel(
    x_ptr,
    y_ptr,
    L,
    S,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_S)
    in_row = cols < S
    keep = in_row
    if CAUSAL:
        keep = keep & (cols <= row % L)
    x = tl.load(x_ptr + row * S + cols, mask=keep, other=-float("inf")).to(COMPUTE)
    e = tl.where(keep, tl.exp(x - tl.max(x, axis=0)), 0.0)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * S + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_bwd_kernel(
    dy_ptr,
    y_ptr,
    dx_ptr,
    S,
    COMPUTE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_S)
    mask = cols < S
    y = tl.load(y_ptr + row * S + cols, mask=mask, other=0.0).to(COMPUTE)
    dy = tl.load(dy_ptr + row * S + cols, mask=mask, other=0.0).to(COMPUTE)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + row * S + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
