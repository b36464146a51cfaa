"""Tiled matmul under the interpreter vs torch matmul computed in float64.

Oracle and tolerances (stated there): tests/helpers/matmul.py.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import matmul
from llmlab.kernels.matmul import reference
from tests.helpers.matmul import TOL, oracle

# (M, N, K): none of these is a multiple of the 32-wide interpreter tiles except the last.
SHAPES = [(45, 37, 70), (1, 33, 17), (33, 1, 5), (64, 64, 64)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_matches_torch(shape, dtype):
    M, N, K = shape
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    torch.testing.assert_close(matmul(a, b), oracle(a, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
def test_fused_bias_activation_epilogue(activation, dtype):
    a, b, bias = (
        torch.randn(21, 19, dtype=dtype),
        torch.randn(19, 40, dtype=dtype),
        torch.randn(40, dtype=dtype),
    )
    out = matmul(a, b, bias, activation)
    torch.testing.assert_close(out, oracle(a, b, bias, activation), **TOL[dtype])
    torch.testing.assert_close(out, reference(a, b, bias, activation), **TOL[dtype])


@pytest.mark.parametrize("blocks", [(16, 16, 16), (16, 64, 32), (64, 16, 16)])
def test_block_sizes_are_parameters(blocks):
    bm, bn, bk = blocks
    a, b = torch.randn(50, 23), torch.randn(23, 70)
    out = matmul(a, b, block_m=bm, block_n=bn, block_k=bk)
    torch.testing.assert_close(out, oracle(a, b), **TOL[torch.float32])


def test_strided_inputs():
    """Transposed views are read through their strides, not copied."""
    a, b = torch.randn(30, 45).t(), torch.randn(20, 30).t()
    torch.testing.assert_close(matmul(a, b), oracle(a, b), **TOL[torch.float32])


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(seed):
    """Shapes drawn at random (seeded), fp32 with a fused bias + GELU."""
    g = torch.Generator().manual_seed(seed)
    M, N, K = (int(v) for v in torch.randint(1, 80, (3,), generator=g))
    a, b, bias = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N)
    out = matmul(a, b, bias, "gelu")
    torch.testing.assert_close(out, oracle(a, b, bias, "gelu"), **TOL[torch.float32])
