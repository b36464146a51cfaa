"""Sparse matrices in CSR and ELL form, SpMV / SpMM kernels, and a COO reference.

Formats (the seed's sparse chapter), for an (R, K) matrix with nnz non-zeros:

* COO: three arrays ``row, col, val`` of length nnz; the simplest, and the reference here:
  ``y = zeros(R).index_add_(0, row, val * x[col])``.
* CSR: ``crow`` (R + 1 offsets), ``col`` and ``val`` (nnz each): row i's entries are
  ``crow[i]:crow[i+1]``. Compact; one program per row.
* ELL: ``col`` and ``val`` of shape (R, W) with W the longest row, padded with (col 0, val 0).
  Regular (every row the same length), wasteful when row lengths vary.

Builders take a dense tensor or any ``torch.sparse`` tensor (COO or CSR layout). :func:`spmv`
and :func:`spmm` dispatch on the format: Triton kernels on GPU (or under the interpreter),
the plain-torch references otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    jit_module,
    next_power_of_2,
    use_triton,
)


def _coo_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, col, val) sorted by row then column, from a dense or torch.sparse 2-D tensor."""
    if a.dim() != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(a.shape)}")
    if a.layout == torch.strided:
        row, col = a.nonzero(as_tuple=True)
        return row, col, a[row, col]
    if a.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        a = a.to_sparse_coo()
    if a.layout != torch.sparse_coo:
        raise ValueError(f"unsupported layout {a.layout}; use dense, sparse_coo or sparse_csr")
    a = a.coalesce()  # sorted (row-major) and duplicates summed
    row, col = a.indices()
    return row, col, a.values()


@dataclass(frozen=True)
class CSRMatrix:
    crow: torch.Tensor  # int32 (R + 1,)
    col: torch.Tensor  # int32 (nnz,)
    val: torch.Tensor  # (nnz,)
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, a: torch.Tensor) -> CSRMatrix:
        return cls._from_coo(*_coo_parts(a), tuple(a.shape))

    @classmethod
    def from_torch(cls, a: torch.Tensor) -> CSRMatrix:
        """From a ``torch.sparse_coo`` or ``torch.sparse_csr`` tensor."""
        return cls._from_coo(*_coo_parts(a), tuple(a.shape))

    @classmethod
    def _from_coo(cls, row, col, val, shape) -> CSRMatrix:
        counts = torch.bincount(row, minlength=shape[0])
        crow = torch.zeros(shape[0] + 1, dtype=torch.int64, device=val.device)
        crow[1:] = counts.cumsum(0)
        return cls(crow.to(torch.int32), col.to(torch.int32), val.contiguous(), shape)

    @property
    def nnz(self) -> int:
        return self.val.numel()

    def to_dense(self) -> torch.Tensor:
        row = torch.repeat_interleave(
            torch.arange(self.shape[0], device=self.val.device), self.crow.diff().long()
        )
        out = torch.zeros(self.shape, dtype=self.val.dtype, device=self.val.device)
        out[row, self.col.long()] = self.val
        return out

    def to_torch(self) -> torch.Tensor:
        return torch.sparse_csr_tensor(self.crow.long(), self.col.long(), self.val, self.shape)


@dataclass(frozen=True)
class ELLMatrix:
    col: torch.Tensor  # int32 (R, W), padding slots hold column 0
    val: torch.Tensor  # (R, W), padding slots hold 0
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, a: torch.Tensor) -> ELLMatrix:
        return cls._from_coo(*_coo_parts(a), tuple(a.shape))

    @classmethod
    def from_torch(cls, a: torch.Tensor) -> ELLMatrix:
        """From a ``torch.sparse_coo`` or ``torch.sparse_csr`` tensor."""
        return cls._from_coo(*_coo_parts(a), tuple(a.shape))

    @classmethod
    def from_csr(cls, a: CSRMatrix) -> ELLMatrix:
        row = torch.repeat_interleave(
            torch.arange(a.shape[0], device=a.val.device), a.crow.diff().long()
        )
        return cls._from_coo(row, a.col.long(), a.val, a.shape)

    @classmethod
    def _from_coo(cls, row, col, val, shape) -> ELLMatrix:
        R = shape[0]
        counts = torch.bincount(row, minlength=R)
        width = int(counts.max()) if R and row.numel() else 0
        starts = torch.zeros(R, dtype=torch.int64, device=val.device)
        starts[1:] = counts.cumsum(0)[:-1]
        slot = torch.arange(row.numel(), device=val.device) - starts[row]  # position in its row
        ell_col = torch.zeros((R, width), dtype=torch.int32, device=val.device)
        ell_val = torch.zeros((R, width), dtype=val.dtype, device=val.device)
        ell_col[row, slot] = col.to(torch.int32)
        ell_val[row, slot] = val
        return cls(ell_col, ell_val, shape)

    @property
    def width(self) -> int:
        return self.col.shape[1]

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self.shape, dtype=self.val.dtype, device=self.val.device)
        rows = torch.arange(self.shape[0], device=self.val.device)[:, None].expand_as(self.col)
        out.index_put_(
            (rows.reshape(-1), self.col.long().reshape(-1)), self.val.reshape(-1), accumulate=True
        )  # padding adds 0 to column 0
        return out


def coo_spmm_reference(
    row: torch.Tensor, col: torch.Tensor, val: torch.Tensor, n_rows: int, x: torch.Tensor
) -> torch.Tensor:
    """``A @ x`` for A in COO form; ``x`` is (K,) or (K, N). Each entry scatters ``val * x[col]``
    into its row, which is the whole algorithm of sparse times dense."""
    contrib = val[:, None] * x[col] if x.dim() == 2 else val * x[col]
    out = torch.zeros((n_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, row.long(), contrib.to(x.dtype))


def _check_operand(op: str, a: CSRMatrix | ELLMatrix, x: torch.Tensor, ndim: int) -> None:
    if not isinstance(a, (CSRMatrix, ELLMatrix)):
        raise TypeError(f"{op}: a must be a CSRMatrix or ELLMatrix, got {type(a).__name__}")
    check_float(op, "x", x, FLOAT_DTYPES)
    if x.dim() != ndim or x.shape[0] != a.shape[1]:
        want = f"({a.shape[1]},)" if ndim == 1 else f"({a.shape[1]}, N)"
        raise ValueError(
            f"{op}: x must have shape {want} for a {a.shape} matrix, got {tuple(x.shape)}"
        )
    if x.dtype != a.val.dtype:
        raise TypeError(f"{op}: x is {x.dtype} but the matrix values are {a.val.dtype}")


def _reference(a: CSRMatrix | ELLMatrix, x: torch.Tensor) -> torch.Tensor:
    if isinstance(a, CSRMatrix):
        row = torch.repeat_interleave(
            torch.arange(a.shape[0], device=x.device), a.crow.diff().long()
        )
        return coo_spmm_reference(row, a.col, a.val, a.shape[0], x)
    rows = torch.arange(a.shape[0], device=x.device)[:, None].expand_as(a.col)
    return coo_spmm_reference(rows.reshape(-1), a.col.reshape(-1), a.val.reshape(-1), a.shape[0], x)


def spmv(a: CSRMatrix | ELLMatrix, x: torch.Tensor) -> torch.Tensor:
    """``y = A x`` for a CSR or ELL matrix A (R, K) and a dense vector x (K,)."""
    _check_operand("spmv", a, x, 1)
    if not use_triton("spmv", a.val, x) or a.shape[0] == 0:
        return _reference(a, x)
    x = x.contiguous()
    y = torch.empty(a.shape[0], dtype=x.dtype, device=x.device)
    jit = jit_module("sparse")
    compute = compute_dtype(x.dtype)
    if isinstance(a, CSRMatrix):
        jit.csr_spmv_kernel[(a.shape[0],)](a.crow, a.col, a.val, x, y, COMPUTE=compute, BLOCK=32)
    else:
        block_r = 32
        block_w = min(32, max(1, next_power_of_2(a.width)))
        jit.ell_spmv_kernel[((a.shape[0] + block_r - 1) // block_r,)](
            a.col,
            a.val,
            x,
            y,
            a.shape[0],
            a.width,
            COMPUTE=compute,
            BLOCK_R=block_r,
            BLOCK_W=block_w,
        )
    return y


def spmm(a: CSRMatrix | ELLMatrix, x: torch.Tensor) -> torch.Tensor:
    """``Y = A X`` for a CSR or ELL matrix A (R, K) and a dense matrix X (K, N)."""
    _check_operand("spmm", a, x, 2)
    if not use_triton("spmm", a.val, x) or a.shape[0] == 0 or x.shape[1] == 0:
        return _reference(a, x)
    x = x.contiguous()
    N = x.shape[1]
    y = torch.empty((a.shape[0], N), dtype=x.dtype, device=x.device)
    jit = jit_module("sparse")
    compute = compute_dtype(x.dtype)
    block_n = min(64, next_power_of_2(N))
    grid = (a.shape[0], (N + block_n - 1) // block_n)
    if isinstance(a, CSRMatrix):
        jit.csr_spmm_kernel[grid](
            a.crow, a.col, a.val, x, y, N, COMPUTE=compute, BLOCK_NNZ=16, BLOCK_N=block_n
        )
    else:
        block_w = min(16, max(1, next_power_of_2(a.width)))
        jit.ell_spmm_kernel[grid](
            a.col, a.val, x, y, a.width, N, COMPUTE=compute, BLOCK_W=block_w, BLOCK_N=block_n
        )
    return y
