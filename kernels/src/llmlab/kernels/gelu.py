"""GELU (tanh form, GPT-2's ``gelu_new``) and the fused ``gelu(x + bias)``, with autograd.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (``F.gelu(x + bias,
approximate="tanh")``), the Triton launchers :func:`triton_bias_gelu_forward` /
:func:`triton_bias_gelu_backward`, and the public ops :func:`gelu` and :func:`bias_gelu`. The bias
gradient is the column sum of ``dx``, done by torch in fp32 after the kernel (a reduction over rows,
not the part fusion speeds up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.kernels._runtime import FLOAT_DTYPES, check_float, compute_dtype, jit_module, use_triton

BLOCK = 1024


def reference(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x + bias)`` with torch ops (autograd by torch)."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def triton_bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    import triton

    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    C = x.shape[-1] if x.dim() else 1
    jit_module("gelu").bias_gelu_fwd_kernel[(triton.cdiv(n, BLOCK),)](
        x,
        bias.contiguous() if bias is not None else x,
        y,
        n,
        C,
        HAS_BIAS=bias is not None,
        COMPUTE=compute_dtype(x.dtype),
        BLOCK=BLOCK,
    )
    return y


def triton_bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    import triton

    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n = x.numel()
    C = x.shape[-1] if x.dim() else 1
    jit_module("gelu").bias_gelu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
        dy,
        x,
        bias.contiguous() if bias is not None else x,
        dx,
        n,
        C,
        HAS_BIAS=bias is not None,
        COMPUTE=compute_dtype(x.dtype),
        BLOCK=BLOCK,
    )
    return dx


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, bias)
        return triton_bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        dx = triton_bias_gelu_backward(dy, x, bias)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            acc = torch.float64 if dx.dtype == torch.float64 else torch.float32
            dbias = dx.reshape(-1, bias.shape[0]).sum(0, dtype=acc).to(bias.dtype)
        return dx, dbias


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Fused ``gelu_tanh(x + bias)``; ``bias`` has shape ``(x.shape[-1],)``. Autograd for both."""
    check_float("bias_gelu", "x", x, FLOAT_DTYPES)
    if bias is not None:
        if bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
            raise ValueError(
                f"bias_gelu: bias must have shape (x.shape[-1],), got {tuple(bias.shape)} "
                f"for x of shape {tuple(x.shape)}"
            )
        if bias.dtype != x.dtype:
            raise TypeError(f"bias_gelu: x is {x.dtype} but bias is {bias.dtype}; they must match")
    if use_triton("bias_gelu", x, bias):
        return _BiasGelu.apply(x, bias)
    return reference(x, bias)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: same as ``F.gelu(x, approximate="tanh")``. Autograd."""
    check_float("gelu", "x", x, FLOAT_DTYPES)
    if use_triton("gelu", x):
        return _BiasGelu.apply(x, None)
    return reference(x)
