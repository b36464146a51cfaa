"""Tiled matmul ``C = act(A @ B + bias)``: the seed's shared-memory tiling, written in Triton.

Each program owns one ``BLOCK_M x BLOCK_N`` tile of C. It walks K in ``BLOCK_K`` steps, loading
an ``A`` tile and a ``B`` tile (Triton stages them through shared memory) and accumulating their
product in fp32 registers: every element of A is read ``N / BLOCK_N`` times from global memory
instead of ``N`` times. Programs are ordered in groups of ``GROUP_M`` tile-rows so that tiles
running at the same time share A and B tiles in L2. Edges are masked, so any M, N, K works.
"""

import triton
import triton.language as tl

from llmlab.kernels._jit.activations import gelu_tanh


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "" | "gelu" | "relu"
    ACC_DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M tile-rows are swept column by column before moving on.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge wrap around (% M, % N) instead of being masked: the loads stay
    # unmasked along M and N (cheaper, vectorisable) and the extra results are never stored.
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        # Only K needs a mask: out-of-range k must contribute exactly zero to the dot product.
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Epilogue, fused: bias and activation are applied while the tile is still in registers.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC_DTYPE)
        acc = acc + bias[None, :]
    if ACTIVATION == "gelu":
        acc = gelu_tanh(acc)
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _gpu_configs() -> list:
    """Tile shapes to autotune over on a GPU (Hopper/Ampere-friendly, from Triton's tutorial)."""
    shapes = [
        # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 3, 8),
        (64, 256, 64, 4, 4),
        (256, 64, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (64, 64, 32, 5, 2),
        (32, 64, 32, 5, 2),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in shapes
    ]


# Same kernel, block sizes chosen by benchmarking each config once per (M, N, K, dtypes).
matmul_kernel_autotuned = triton.autotune(configs=_gpu_configs(), key=["M", "N", "K"])(
    matmul_kernel
)
