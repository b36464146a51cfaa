"""Naive matmul, one program per output element: the baseline the tiled :mod:`matmul` beats.

Three faces (docs/architecture.md#kernels-three-faces): :func:`reference` (plain torch, the
same oracle as the tiled matmul's), :func:`triton_naive_matmul` (launches
``_jit/naive_matmul.py``) and :func:`naive_matmul` (validates, then dispatches). Inputs may be
fp32, fp16, bf16 (or fp64); products are accumulated in fp32 (fp64 for fp64) and the result has
the input dtype. It exists to be measured against the tiled kernel (kernels/README.md, "Tiled
matmul"), not to be used: each element of A is read N times from global memory.
"""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import compute_dtype, jit_module, use_triton
from llmlab.kernels.matmul import _validate
from llmlab.kernels.matmul import reference as _tiled_reference

# K is walked in chunks this wide: one chunk of A's row and of B's column per iteration.
BLOCK_K = 32


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in fp32 (fp64 for fp64) and cast back to the input dtype."""
    return _tiled_reference(a, b)


def triton_naive_matmul(a: torch.Tensor, b: torch.Tensor, block_k: int = BLOCK_K) -> torch.Tensor:
    """Launch the kernel on an ``(M, N)`` grid: one program per element of the result."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    jit_module("naive_matmul").naive_matmul_kernel[(M, N)](
        a,
        b,
        c,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        ACC_DTYPE=compute_dtype(a.dtype),
        BLOCK_K=block_k,
    )
    return c


def naive_matmul(a: torch.Tensor, b: torch.Tensor, *, block_k: int = BLOCK_K) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N), one program per output element.
    ``block_k`` (a power of two) is how many k each loop iteration covers."""
    _validate(a, b, None, None, (None, None, None))
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"naive_matmul: block_k={block_k} must be a power of two")
    if use_triton("naive_matmul", a, b):
        return triton_naive_matmul(a, b, block_k)
    return reference(a, b)
