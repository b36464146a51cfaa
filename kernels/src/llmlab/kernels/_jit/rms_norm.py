"""RMSNorm forward (saving rstd) and backward, one row per program as in ``layer_norm.py``.

Forward: ``y = x * rstd * w`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``; unlike LayerNorm there
is no mean to subtract and no bias. ``rstd`` is saved so the backward never recomputes it.

Backward: with ``xhat = x * rstd`` and ``g = dy * w``,
``dx = rstd * (g - xhat * mean(g * xhat))`` (LayerNorm's formula without the ``mean(g)`` term,
because no mean was subtracted) and ``dw = sum_rows(dy * xhat)``. Each program walks rows
``pid, pid + P, ...`` and keeps its share of ``dw`` in registers; the P partial rows are summed
afterwards by torch.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    C,
    eps,
    COMPUTE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(COMPUTE)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(COMPUTE)
    tl.store(y_ptr + row * C + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    C,
    COMPUTE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(COMPUTE)
    dw = tl.zeros((BLOCK_C,), dtype=COMPUTE)
    row_stride = tl.cast(C, tl.int64)  # row * C in 64 bits: large activations pass 2^31 elements
    for row in range(pid, n_rows, n_programs):
        offs = row * row_stride + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        mean_gx = tl.sum(g * xhat, axis=0) / C
        dx = (g - xhat * mean_gx) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_partial_ptr + pid * C + cols, dw, mask=mask)
