"""Naive matmul (one program per output element) under the interpreter vs torch in float64.

Same oracle and tolerances as the tiled matmul (tests/helpers/matmul.py): fp32 accumulation,
one rounding to the output dtype. Shapes are small: the grid has M·N programs and the
interpreter runs them one after another.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import matmul, naive_matmul
from tests.helpers.matmul import TOL, oracle

# (M, N, K): K below, equal to and past the 32-wide chunk, and not a multiple of it.
SHAPES = [(7, 5, 3), (9, 6, 32), (5, 11, 70)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
def test_naive_matmul_matches_torch(shape, dtype):
    M, N, K = shape
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    torch.testing.assert_close(naive_matmul(a, b), oracle(a, b), **TOL[dtype])


@pytest.mark.parametrize("block_k", [4, 64])
def test_chunk_width_changes_only_the_summation_order(block_k):
    a, b = torch.randn(6, 37), torch.randn(37, 5)
    torch.testing.assert_close(
        naive_matmul(a, b, block_k=block_k), oracle(a, b), **TOL[torch.float32]
    )


def test_strided_inputs_and_agreement_with_the_tiled_kernel():
    """Transposed views go through their strides; naive and tiled give the same product."""
    a, b = torch.randn(40, 9).t(), torch.randn(13, 40).t()
    out = naive_matmul(a, b)
    torch.testing.assert_close(out, oracle(a, b), **TOL[torch.float32])
    torch.testing.assert_close(out, matmul(a, b), **TOL[torch.float32])


def test_the_kernel_itself_ran():
    """An output written by the kernel, not the reference: the launch fills every element."""
    from llmlab.kernels.naive_matmul import triton_naive_matmul

    a, b = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(triton_naive_matmul(a, b), a @ b, **TOL[torch.float32])
