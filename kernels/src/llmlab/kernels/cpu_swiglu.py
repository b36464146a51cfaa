"""SwiGLU ``silu(a) * b`` fused on the CPU: one pass over memory forward, one backward
(``cpu/swiglu.cpp``), with autograd for both inputs.

Eager PyTorch moves each (tokens, width) activation of a gated MLP through five full-size
passes (``silu``, the product; backward: two products and ``silu_backward``); the fused kernel
reads and writes each tensor once per direction and repeats PyTorch's arithmetic op for op
(its vectorized ``silu`` / ``silu_backward`` formulas, the same Sleef ``exp``), so its results
equal :func:`llmlab.kernels.swiglu.reference`'s bit for bit on this build (tested; a build
whose compiler contracts differently may differ in the last bit). It is the ``swiglu`` of the
models' ``kernels="cpu"`` op table; :func:`cpu_swiglu` takes the reference for anything else
(CUDA, other dtypes, or no built kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.kernels.cpu_extension import cpu_kernels
from llmlab.kernels.swiglu import reference


def fused_applies(a: Tensor, b: Tensor) -> bool:
    """Whether the C++ kernel runs ``silu(a) * b`` here: plain fp32 CPU tensors of one shape
    (not a subclass such as a DTensor, whose ops must stay PyTorch's), not under
    ``torch.compile`` (inductor fuses the reference itself), and the kernel built."""
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.device.type == "cpu"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and a.shape == b.shape
        and not torch.compiler.is_compiling()
        and cpu_kernels() is not None
    )


class _CpuSwiGLU(torch.autograd.Function):
    """The fused forward, saving ``a`` and ``b`` (not ``silu(a)``: the backward recomputes it
    in the same pass)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return cpu_kernels().swiglu_forward(a, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        a, b = ctx.saved_tensors
        return tuple(cpu_kernels().swiglu_backward(grad.contiguous(), a, b))


def cpu_swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b``: the fused C++ kernel where :func:`fused_applies`, else the reference."""
    if not fused_applies(a, b):
        return reference(a, b)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _CpuSwiGLU.apply(a, b)
    return cpu_kernels().swiglu_forward(a.contiguous(), b.contiguous())
