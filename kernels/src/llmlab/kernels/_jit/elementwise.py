"""``a + b + c`` in one kernel: the seed's fusion example.

Unfused, ``t = a + b; e = t + c`` is two launches with 4 loads and 2 stores per element (the
temporary ``t`` goes to memory and comes back). Fused: 3 loads and 1 store, one launch.
"""

import triton
import triton.language as tl


@triton.jit
def add3_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    c = tl.load(c_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a + b + c, mask=mask)
