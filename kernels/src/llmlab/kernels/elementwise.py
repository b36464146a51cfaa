"""``a + b + c`` fused into one kernel: the seed's example of what fusion saves.

Eager ``(a + b) + c`` launches two kernels and moves 4 loads + 2 stores per element; the fused
kernel moves 3 loads + 1 store (a third less traffic) in one launch. Forward only.
"""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    jit_module,
    use_triton,
)

BLOCK = 1024


def reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The unfused chain: two elementwise kernels with a temporary in between."""
    return (a + b) + c


def triton_add3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    import triton

    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    jit_module("elementwise").add3_kernel[(triton.cdiv(n, BLOCK),)](
        a, b, c, out, n, COMPUTE=compute_dtype(a.dtype), BLOCK=BLOCK
    )
    return out


def add3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a + b + c`` for three tensors of one shape and dtype, in one pass over memory."""
    for name, t in (("a", a), ("b", b), ("c", c)):
        check_float("add3", name, t, FLOAT_DTYPES)
        if t.shape != a.shape or t.dtype != a.dtype:
            raise ValueError(
                f"add3: {name} is {tuple(t.shape)} {t.dtype} but a is {tuple(a.shape)} {a.dtype};"
                " all three must have the same shape and dtype"
            )
    if use_triton("add3", a, b, c):
        return triton_add3(a, b, c)
    return reference(a, b, c)
