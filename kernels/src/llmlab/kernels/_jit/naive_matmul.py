"""Naive matmul ``C = A @ B``: one program per output element, a loop over K (the seed's first
CUDA matmul, where each thread computes one ``C[m, n]``).

Program ``(m, n)`` walks K in ``BLOCK_K``-wide chunks: it loads ``A[m, k:k+BLOCK_K]`` and
``B[k:k+BLOCK_K, n]`` from global memory, multiplies them elementwise and adds their sum to one
fp32 accumulator. Nothing it loads is shared with any other program, so every element of A is
read ``N`` times and every element of B ``M`` times: ``2·M·N·K`` loads for ``2·M·N·K`` flops,
one flop per element loaded whatever ``BLOCK_K`` is (the lanes of a chunk only split the dot
product). ``_jit/matmul.py`` is the tiled version that fixes this.
"""

import triton
import triton.language as tl


@triton.jit
def naive_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    ACC_DTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)
    n = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask = k < K
        # A row segment (contiguous when A is row-major) and a B column segment (strided by
        # stride_bk: neighbouring lanes are a whole row of B apart, uncoalesced).
        a = tl.load(a_ptr + m * stride_am + k * stride_ak, mask=mask, other=0.0)
        b = tl.load(b_ptr + k * stride_bk + n * stride_bn, mask=mask, other=0.0)
        # Products in the accumulator's precision (fp32, fp64 for fp64), as cuBLAS accumulates.
        acc += a.to(ACC_DTYPE) * b.to(ACC_DTYPE)
    c = tl.sum(acc, axis=0)
    tl.store(c_ptr + m * stride_cm + n * stride_cn, c.to(c_ptr.dtype.element_ty))
