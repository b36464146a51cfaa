"""LayerNorm over the last dimension, optionally fused with the residual add before it.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (``F.layer_norm`` of ``x +
residual``), the Triton launchers :func:`triton_forward` / :func:`triton_backward`, and the public
ops :func:`layer_norm` (same semantics as ``F.layer_norm(x, (C,), weight, bias, eps)``) and
:func:`add_layer_norm` (returns ``(layer_norm(x + residual), x + residual)``, the pre-norm
transformer's "add & norm"). The forward saves per-row ``mean`` and ``rstd``; the backward computes
the input gradient in one pass and the weight/bias gradients as per-program partial sums that torch
adds up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.layer_norm(x + residual, (C,), weight, bias, eps)``."""
    z = x if residual is None else x + residual
    return F.layer_norm(z, (z.shape[-1],), weight, bias, eps)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_forward(x, residual, weight, bias, eps):
    """Returns ``(y, z, mean, rstd)`` for 2-D contiguous ``x`` (rows, C); ``z`` is ``x`` when
    there is no residual."""
    rows, C = x.shape
    y = torch.empty_like(x)
    z = torch.empty_like(x) if residual is not None else x
    mean = torch.empty(rows, device=x.device, dtype=_stats_dtype(x.dtype))
    rstd = torch.empty_like(mean)
    jit_module("layer_norm").add_layer_norm_fwd_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        z,
        weight,
        bias,
        y,
        mean,
        rstd,
        C,
        eps,
        HAS_RESIDUAL=residual is not None,
        COMPUTE=compute_dtype(x.dtype),
        BLOCK_C=next_power_of_2(C),
    )
    return y, z, mean, rstd


def triton_backward(dy, z, weight, mean, rstd, dz_out):
    """Returns ``(dz, dweight, dbias)``; ``dz_out`` is the gradient reaching ``z`` directly."""
    rows, C = z.shape
    if z.is_cuda:
        programs = torch.cuda.get_device_properties(z.device).multi_processor_count * 4
    else:
        programs = 4 if interpreter_requested() else 1
    programs = max(1, min(rows, programs))
    acc = _stats_dtype(z.dtype)
    dz = torch.empty_like(z)
    dw_partial = torch.empty((programs, C), device=z.device, dtype=acc)
    db_partial = torch.empty_like(dw_partial)
    jit_module("layer_norm").layer_norm_bwd_kernel[(programs,)](
        dy.contiguous(),
        z,
        weight,
        mean,
        rstd,
        dz_out.contiguous() if dz_out is not None else dy,
        dz,
        dw_partial,
        db_partial,
        rows,
        C,
        HAS_DZ_OUT=dz_out is not None,
        COMPUTE=compute_dtype(z.dtype),
        BLOCK_C=next_power_of_2(C),
    )
    return dz, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


class _AddLayerNorm(torch.autograd.Function):
    """Autograd for ``(y, z)`` = (LayerNorm(x + residual), x + residual); y only if no residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        shape = x.shape
        C = shape[-1]
        x2 = x.reshape(-1, C).contiguous()
        r2 = residual.reshape(-1, C).contiguous() if residual is not None else None
        y, z, mean, rstd = triton_forward(x2, r2, weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(z, weight, mean, rstd)
        ctx.has_residual = residual is not None
        ctx.shape = shape
        if residual is None:
            return y.reshape(shape)
        return y.reshape(shape), z.reshape(shape)

    @staticmethod
    def backward(ctx, dy, dz_out=None):
        z, weight, mean, rstd = ctx.saved_tensors
        C = z.shape[1]
        dz_out = dz_out.reshape(-1, C) if dz_out is not None else None
        dz, dw, db = triton_backward(dy.reshape(-1, C), z, weight, mean, rstd, dz_out)
        dz = dz.reshape(ctx.shape)
        return dz, (dz if ctx.has_residual else None), dw, db, None


def _validate(op, x, residual, weight, bias, eps):
    check_float(op, "x", x, FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a scalar")
    C = x.shape[-1]
    if C > MAX_C:
        raise ValueError(f"{op}: last dimension {C} exceeds the {MAX_C} a row kernel supports")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{op}: residual is {tuple(residual.shape)} {residual.dtype}, x is "
            f"{tuple(x.shape)} {x.dtype}; they must match"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (C,):
            raise ValueError(f"{op}: {name} must have shape ({C},), got {tuple(p.shape)}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps!r}")


def _affine(x, weight, bias):
    """Missing weight/bias act as ones/zeros (what F.layer_norm does with None)."""
    C = x.shape[-1]
    if weight is None:
        weight = torch.ones(C, device=x.device, dtype=x.dtype)
    if bias is None:
        bias = torch.zeros(C, device=x.device, dtype=x.dtype)
    return weight, bias


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dim, as ``F.layer_norm(x, (C,), weight, bias, eps)``. Autograd."""
    _validate("layer_norm", x, None, weight, bias, eps)
    if use_triton("layer_norm", x, weight, bias):
        weight, bias = _affine(x, weight, bias)
        return _AddLayerNorm.apply(x, None, weight, bias, eps)
    return reference(x, weight, bias, eps)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` in one pass; autograd through both outputs."""
    _validate("add_layer_norm", x, residual, weight, bias, eps)
    if use_triton("add_layer_norm", x, residual, weight, bias):
        weight, bias = _affine(x, weight, bias)
        return _AddLayerNorm.apply(x, residual, weight, bias, eps)
    z = x + residual
    return reference(z, weight, bias, eps), z
