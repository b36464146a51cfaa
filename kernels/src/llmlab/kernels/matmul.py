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


def launch_arguments(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, tuple, dict]:
    """The output ``c`` and the kernel's positional and flag arguments (everything but the tile
    sizes and launch options), for :func:`triton_matmul` and the tile-sweep benchmark."""
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
    return c, args, flags


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
    M, N = a.shape[0], b.shape[1]
    c, args, flags = launch_arguments(a, b, bias, activation)
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


# ------------------------------------------------------------------------------ tile sweep
# Tile shapes swept by ``benchmarks/matmul_tiles.py`` and checked under the interpreter
# (tests/kernels/interpreter/test_matmul_tiles.py): (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
# num_warps), from tiles too small to reuse anything to tiles that no longer fit an SM.
TILE_SWEEP = (
    (16, 16, 16, 2, 1),
    (32, 32, 32, 3, 2),
    (64, 64, 32, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (128, 128, 64, 3, 8),
    (128, 256, 64, 3, 8),
    (256, 128, 64, 4, 8),
    (256, 256, 64, 3, 8),
    (256, 256, 128, 3, 8),
)

# NVIDIA's published per-SM limits (CUDA programming guide, compute capabilities 8.0 and 9.0).
SMEM_PER_SM = {"A100": 164 * 1024, "H100": 228 * 1024}  # bytes of shared memory per SM
REGISTERS_PER_SM = 65536  # 32-bit registers, both
MAX_REGISTERS_PER_THREAD = 255
MAX_WARPS_PER_SM = 64


def tile_costs(
    block_m: int, block_n: int, block_k: int, num_stages: int, num_warps: int, dtype_bytes: int = 2
) -> dict[str, float]:
    """What one program of the tiled kernel asks of an SM, by exact arithmetic (a model: the
    compiler adds scratch space and registers of its own; the GPU benchmark reads the real ones).

    * ``stage_bytes``: one A tile and one B tile, ``(BM·BK + BK·BN)·dtype_bytes``; the pipeline
      keeps ``num_stages`` of them in shared memory (``smem_bytes``) so loads overlap the dots.
    * ``acc_regs_per_thread``: the ``BM×BN`` fp32 accumulator spread over ``32·num_warps``
      threads (one 32-bit register per element), a floor under the real register count.
    * ``programs_per_sm_*``: how many programs fit on one SM at once by shared memory (per GPU),
      by registers (accumulator only) and by the 64-warp limit; occupancy is the smallest.
    * ``flops_per_byte``: ``2·BM·BN·BK`` flops per stage over the bytes that stage loads,
      ``= 2·BM·BN / ((BM + BN)·dtype_bytes)``: bigger tiles reuse each loaded element more.
    """
    stage = (block_m * block_k + block_k * block_n) * dtype_bytes
    smem = stage * num_stages
    threads = 32 * num_warps
    acc_regs = block_m * block_n / threads
    out = {
        "stage_bytes": stage,
        "smem_bytes": smem,
        "acc_regs_per_thread": acc_regs,
        "flops_per_byte": 2 * block_m * block_n * block_k / stage,
        # past 255 registers a thread spills the accumulator to local memory: none fit whole
        "programs_per_sm_regs": 0
        if acc_regs > MAX_REGISTERS_PER_THREAD
        else int(REGISTERS_PER_SM // (threads * acc_regs)),
        "programs_per_sm_warps": MAX_WARPS_PER_SM // num_warps,
    }
    for gpu, capacity in SMEM_PER_SM.items():
        out[f"programs_per_sm_smem_{gpu}"] = capacity // smem
    return out
