"""Coalesced versus strided memory access, as copy and transpose kernels (benchmark demos).

The kernels (``_jit/access_patterns.py``) compute the same results two ways; only their access
pattern differs, which is what ``benchmarks/kernels.py`` measures in GB/s. References:
``x.clone()`` and ``x.t().contiguous()``. These run only as Triton kernels (GPU or interpreter).
"""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import jit_module, use_triton

BLOCK = 1024


def copy(x: torch.Tensor, coalesced: bool = True) -> torch.Tensor:
    """Copy ``x`` with neighbouring lanes on neighbouring addresses (``coalesced``) or not."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if not use_triton("copy", x):
        return y.copy_(x)
    jit = jit_module("access_patterns")
    kernel = jit.copy_coalesced_kernel if coalesced else jit.copy_strided_kernel
    n = x.numel()
    kernel[((n + BLOCK - 1) // BLOCK,)](x, y, n, BLOCK=BLOCK)
    return y


def transpose(x: torch.Tensor, tiled: bool = True, block: int = 32) -> torch.Tensor:
    """``x.T`` (2-D) as a contiguous tensor, by square tiles (``tiled``) or row by row."""
    if x.dim() != 2:
        raise ValueError(f"transpose: expected a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.contiguous()
    M, N = x.shape
    y = torch.empty((N, M), dtype=x.dtype, device=x.device)
    if not use_triton("transpose", x):
        return y.copy_(x.t())
    import triton

    jit = jit_module("access_patterns")
    if tiled:
        grid = (triton.cdiv(M, block), triton.cdiv(N, block))
        jit.transpose_tiled_kernel[grid](x, y, M, N, BLOCK_M=block, BLOCK_N=block)
    else:
        jit.transpose_naive_kernel[(M, triton.cdiv(N, BLOCK))](x, y, M, N, BLOCK=BLOCK)
    return y
