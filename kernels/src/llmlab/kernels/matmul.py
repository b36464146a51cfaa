"""Tiled matmul with an optional fused ``bias + activation`` epilogue.

Three faces (docs/architecture.md#kernels-three-faces): :func:`reference` (plain torch),
:func:`triton_matmul` (launches ``_jit/matmul.py``) and :func:`matmul` (validates, then dispatches).
Inputs may be fp32, fp16, bf16 (or fp64); products are accumulated in fp32 (fp64 for fp64) and the
result has the input dtype, as cuBLAS does. No autograd: this op is the forward building block and
benchmark subject."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    dot_in_fp32,
    dot_precision,
    interpreter_requested,
    jit_module,
    use_triton,
)

ACTIVATIONS = (None, "gelu", "relu")
# Interpreter defaults: 32-wide tiles are ~7x faster to interpret than 16-wide (FIELD-NOTES).
INTERPRETER_BLOCKS = (32, 32, 32)


def reference(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(a @ b + bias)`` computed in fp32 (fp64 for fp64) and cast back to the input dtype."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = a.to(acc) @ b.to(acc)
    if bias is not None:
        out = out + bias.to(acc)
    if activation == "gelu":
        out = F.gelu(out, approximate="tanh")
    elif activation == "relu":
        out = torch.relu(out)
    return out.to(a.dtype)


def _validate(a, b, bias, activation, blocks) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"matmul: expected 2-D a (M, K) and b (K, N), got shapes {tuple(a.shape)} "
            f"and {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"matmul: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
            f"(a.shape[1]={a.shape[1]} must equal b.shape[0]={b.shape[0]})"
        )
    check_float("matmul", "a", a, FLOAT_DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b is {b.dtype}; they must match")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ValueError(
            f"matmul: bias must have shape ({b.shape[1]},) = (N,), got {tuple(bias.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation={activation!r} is not one of {list(ACTIVATIONS)}")
    for name, value in zip(("block_m", "block_n", "block_k"), blocks):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(
                f"matmul: {name}={value} must be a power of two >= 16 (tl.dot's minimum tile)"
            )


def triton_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    group_m: int = 8,
) -> torch.Tensor:
    """Launch the Triton kernel. Without block sizes: autotuned on a GPU, 32s when interpreted."""
    import triton

    jit = jit_module("matmul")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    args = (
        a,
        b,
        c,
        bias.contiguous()
        if bias is not None
        else c,  # dummy pointer, never read when HAS_BIAS is False
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
    )
    flags = {
        "HAS_BIAS": bias is not None,
        "ACTIVATION": activation or "",
        "ACC_DTYPE": compute_dtype(a.dtype),
        "DOT_IN_FP32": dot_in_fp32(a.dtype),
        "INPUT_PRECISION": dot_precision(a),
    }
    explicit = (block_m, block_n, block_k) != (None, None, None)
    if explicit or interpreter_requested():
        bm, bn, bk = (
            x if x is not None else d
            for x, d in zip((block_m, block_n, block_k), INTERPRETER_BLOCKS)
        )
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        jit.matmul_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    else:

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        jit.matmul_kernel_autotuned[grid](*args, **flags)
    return c


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``act(a @ b + bias)`` for 2-D ``a`` (M, K) and ``b`` (K, N); ``activation`` in
    ``None | "gelu" | "relu"`` (GELU is the tanh form). Block sizes are optional overrides."""
    _validate(a, b, bias, activation, (block_m, block_n, block_k))
    if use_triton("matmul", a, b, bias):
        return triton_matmul(a, b, bias, activation, block_m, block_n, block_k)
    return reference(a, b, bias, activation)
