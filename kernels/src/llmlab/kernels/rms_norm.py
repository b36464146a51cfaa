"""RMSNorm over the last dimension (Llama's norm: no mean subtraction, no bias), with autograd.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (HF ``LlamaRMSNorm``'s
arithmetic: normalise in fp32, round to the input dtype, then scale by the weight), the Triton
launchers :func:`triton_forward` / :func:`triton_backward` (``_jit/rms_norm.py``), and the public op
:func:`rms_norm`. The forward saves one ``rstd`` per row; the backward computes the input gradient
in one pass and the weight gradient as per-program partial sums that torch adds up."""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    interpreter_requested,
    jit_module,
    next_power_of_2,
    use_triton,
)

MAX_C = 65536  # one row must fit in one program's registers


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x²) + eps))``, the statistics in fp32 (fp64 for fp64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` for 2-D contiguous ``x`` (rows, C)."""
    rows, C = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=x.device, dtype=_stats_dtype(x.dtype))
    jit_module("rms_norm").rms_norm_fwd_kernel[(rows,)](
        x, weight, y, rstd, C, eps, COMPUTE=compute_dtype(x.dtype), BLOCK_C=next_power_of_2(C)
    )
    return y, rstd


def triton_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)``."""
    rows, C = x.shape
    if x.is_cuda:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count * 4
    else:
        programs = 4 if interpreter_requested() else 1
    programs = max(1, min(rows, programs))
    dx = torch.empty_like(x)
    dw_partial = torch.empty((programs, C), device=x.device, dtype=_stats_dtype(x.dtype))
    jit_module("rms_norm").rms_norm_bwd_kernel[(programs,)](
        dy.contiguous(),
        x,
        weight,
        rstd,
        dx,
        dw_partial,
        rows,
        C,
        COMPUTE=compute_dtype(x.dtype),
        BLOCK_C=next_power_of_2(C),
    )
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        C = x.shape[-1]
        x2 = x.reshape(-1, C).contiguous()
        y, rstd = triton_forward(x2, weight.contiguous(), eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = triton_backward(dy.reshape(x2.shape), x2, weight, rstd)
        return dx.reshape(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension, as HF's ``LlamaRMSNorm``. Autograd for x and weight."""
    check_float("rms_norm", "x", x, FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension, got a scalar")
    C = x.shape[-1]
    if C > MAX_C:
        raise ValueError(f"rms_norm: last dimension {C} exceeds the {MAX_C} a row kernel supports")
    if tuple(weight.shape) != (C,):
        raise ValueError(f"rms_norm: weight must have shape ({C},), got {tuple(weight.shape)}")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be > 0, got {eps!r}")
    if use_triton("rms_norm", x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return reference(x, weight, eps)
