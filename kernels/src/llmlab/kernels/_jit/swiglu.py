"""SwiGLU ``silu(a) * b`` forward and backward: the gated MLP's activation in one pass each way.

Unfused, ``silu(a)`` writes a temporary that the product reads back, and the backward needs
``silu(a)`` again plus ``sigmoid(a)``. Fused, each element of ``a`` and ``b`` is loaded once and
the output (or the two gradients) stored once; the backward recomputes ``sigmoid(a)`` from the
saved ``a`` instead of saving it:
``da = dy * b * s * (1 + a * (1 - s))`` and ``db = dy * a * s``, with ``s = sigmoid(a)``.
"""

import triton
import triton.language as tl

from llmlab.kernels._jit.activations import silu, silu_grad


@triton.jit
def swiglu_fwd_kernel(a_ptr, b_ptr, y_ptr, n_elements, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(y_ptr + offs, (silu(a) * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    dy_ptr,
    a_ptr,
    b_ptr,
    da_ptr,
    db_ptr,
    n_elements,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(da_ptr + offs, (dy * b * silu_grad(a)).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (dy * silu(a)).to(db_ptr.dtype.element_ty), mask=mask)
