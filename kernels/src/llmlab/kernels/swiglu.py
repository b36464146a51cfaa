"""SwiGLU, the gated MLP activation ``silu(a) * b`` (Llama: ``down(silu(gate(x)) * up(x))``).

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (``F.silu(a) * b``), the Triton
launchers :func:`triton_forward` / :func:`triton_backward` (``_jit/swiglu.py``: one pass over memory
each way, ``sigmoid(a)`` recomputed in the backward rather than saved), and the public op
:func:`swiglu` with autograd for both inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.kernels._runtime import FLOAT_DTYPES, check_float, compute_dtype, jit_module, use_triton

BLOCK = 1024


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` with torch ops (autograd by torch)."""
    return F.silu(a) * b


def triton_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import triton

    y = torch.empty_like(a)
    n = a.numel()
    jit_module("swiglu").swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](
        a, b, y, n, COMPUTE=compute_dtype(a.dtype), BLOCK=BLOCK
    )
    return y


def triton_backward(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    jit_module("swiglu").swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
        dy.contiguous(), a, b, da, db, n, COMPUTE=compute_dtype(a.dtype), BLOCK=BLOCK
    )
    return da, db


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return triton_forward(a, b)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        return triton_backward(dy, a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for tensors of one shape and dtype. Autograd for both."""
    check_float("swiglu", "a", a, FLOAT_DTYPES)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"swiglu: a is {tuple(a.shape)} {a.dtype}, b is {tuple(b.shape)} {b.dtype}; "
            "they must match (the gate and up projections of one MLP)"
        )
    if use_triton("swiglu", a, b):
        return _SwiGLU.apply(a, b)
    return reference(a, b)
