"""Sparse kernels (CSR/ELL SpMV and SpMM) and the memory-access demos under the interpreter.

Oracles: ``torch.sparse.mm`` / dense ``@`` in float64, and the COO reference. Tolerances: the
kernels accumulate in fp32 and round once, so fp32 atol/rtol 1e-5, fp16 2e-3 (2 eps), bf16
1.6e-2 (2 eps) against the float64 result rounded to the dtype. Copies and transposes are exact.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import CSRMatrix, ELLMatrix, coo_spmm_reference, copy, spmm, spmv, transpose

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def random_sparse(rows, cols, density, dtype):
    """Dense matrix with uneven row lengths, an empty row and a full row."""
    a = torch.randn(rows, cols) * (torch.rand(rows, cols) < density)
    a[1] = 0.0
    a[-1] = torch.randn(cols)
    return a.to(dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("fmt", [CSRMatrix, ELLMatrix])
@pytest.mark.parametrize("shape", [(21, 50), (5, 70)])
def test_spmv_and_spmm(shape, fmt, dtype):
    dense = random_sparse(*shape, 0.2, dtype)
    a = fmt.from_dense(dense)
    x = torch.randn(shape[1], dtype=dtype)
    X = torch.randn(shape[1], 19, dtype=dtype)
    sparse64 = dense.double().to_sparse()
    want_v = torch.sparse.mm(sparse64, x.double()[:, None])[:, 0].to(dtype)
    want_m = torch.sparse.mm(sparse64, X.double()).to(dtype)
    torch.testing.assert_close(spmv(a, x), want_v, **TOL[dtype])
    torch.testing.assert_close(spmm(a, X), want_m, **TOL[dtype])


def test_formats_from_torch_sparse_run_the_kernels():
    dense = random_sparse(20, 30, 0.3, torch.float32)
    X = torch.randn(30, 20)
    want = dense @ X
    for source in (dense.to_sparse(), dense.to_sparse_csr()):
        for fmt in (CSRMatrix, ELLMatrix):
            torch.testing.assert_close(spmm(fmt.from_torch(source), X), want, **TOL[torch.float32])
    csr = CSRMatrix.from_dense(dense)
    torch.testing.assert_close(
        spmv(ELLMatrix.from_csr(csr), X[:, 0]), want[:, 0], atol=1e-5, rtol=1e-5
    )
    row, col = dense.nonzero(as_tuple=True)
    torch.testing.assert_close(
        coo_spmm_reference(row, col, dense[row, col], 20, X), want, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("n", [1, 3000])
def test_copy_both_access_patterns(n, coalesced):
    x = torch.randn(n)
    assert torch.equal(copy(x, coalesced=coalesced), x)


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("shape", [(37, 45), (1, 70), (64, 32)])
def test_transpose_both_access_patterns(shape, tiled):
    x = torch.randn(shape)
    assert torch.equal(transpose(x, tiled=tiled), x.t().contiguous())
