"""``a + b + c`` in one kernel: the seed's fusion example.

Unfused, ``t = a + b; e = t + c`` is two launches with 4 loads and 2 stores per element (the
temporary ``t`` goes to memory and comes back). Fused: 3 loads and 1 store, one launch.
The sum is formed in fp32 (fp64 for fp64) and rounded once, so for fp16/bf16 it is at least as
accurate as the eager chain, which rounds after each addition. (Computing in fp32 also avoids the
Triton 3.9 interpreter's bf16 arithmetic, which operates on the raw uint16 storage.)
"""

import triton
import triton.language as tl


@triton.jit
def add3_kernel(
    a_ptr, b_ptr, c_ptr, out_ptr, n_elements, COMPUTE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(a_ptr + offs, mask=mask).to(COMPUTE)
    b = tl.load(b_ptr + offs, mask=mask).to(COMPUTE)
    c = tl.load(c_ptr + offs, mask=mask).to(COMPUTE)
    tl.store(out_ptr + offs, (a + b + c).to(out_ptr.dtype.element_ty), mask=mask)
