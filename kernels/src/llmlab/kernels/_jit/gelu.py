"""Fused ``gelu(x + bias)`` forward and backward: one pass over memory each way.

Unfused, ``x + bias`` writes a temporary that GELU reads back; fused, each element is loaded
once, biased and activated in registers, and stored once. The backward recomputes ``x + bias``
instead of saving it, trading a few flops for one tensor of memory.
"""

import triton
import triton.language as tl

from llmlab.kernels._jit.activations import gelu_tanh, gelu_tanh_grad


@triton.jit
def bias_gelu_fwd_kernel(
    x_ptr,
    bias_ptr,
    y_ptr,
    n_elements,
    C,
    HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    if HAS_BIAS:
        u += tl.load(bias_ptr + offs % C, mask=mask, other=0.0).to(COMPUTE)
    tl.store(y_ptr + offs, gelu_tanh(u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_bwd_kernel(
    dy_ptr,
    x_ptr,
    bias_ptr,
    dx_ptr,
    n_elements,
    C,
    HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    if HAS_BIAS:
        u += tl.load(bias_ptr + offs % C, mask=mask, other=0.0).to(COMPUTE)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(dx_ptr + offs, (dy * gelu_tanh_grad(u)).to(dx_ptr.dtype.element_ty), mask=mask)
