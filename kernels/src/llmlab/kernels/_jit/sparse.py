"""SpMV / SpMM kernels for CSR and ELL matrices (the seed's sparse chapter).

CSR (compressed sparse row): ``crow[i]:crow[i+1]`` indexes row i's entries in ``col``/``val``.
One program per row walks its own entries, so rows of very different lengths make programs of
very different lengths (load imbalance), and neighbouring programs read unrelated addresses.

ELL (ELLPACK): every row padded to the same width W; ``col``/``val`` are (rows, W) with padding
value 0. Each program handles a block of rows and the W slots in lockstep: regular, vector
friendly access, paid for with the padding when row lengths vary.
"""

import triton
import triton.language as tl


@triton.jit
def csr_spmv_kernel(
    crow_ptr, col_ptr, val_ptr, x_ptr, y_ptr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    start = tl.load(crow_ptr + row)
    end = tl.load(crow_ptr + row + 1)
    acc = tl.zeros((BLOCK,), dtype=COMPUTE)
    for i in range(start, end, BLOCK):
        idx = i + tl.arange(0, BLOCK)
        mask = idx < end
        cols = tl.load(col_ptr + idx, mask=mask, other=0)
        vals = tl.load(val_ptr + idx, mask=mask, other=0.0).to(COMPUTE)
        acc += vals * tl.load(x_ptr + cols, mask=mask, other=0.0).to(COMPUTE)
    tl.store(y_ptr + row, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty))


@triton.jit
def csr_spmm_kernel(
    crow_ptr,
    col_ptr,
    val_ptr,
    x_ptr,
    y_ptr,
    N,
    COMPUTE: tl.constexpr,
    BLOCK_NNZ: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Y[row, n-block] = sum over row's entries of val * X[col, n-block]; X is (K, N)."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    start = tl.load(crow_ptr + row)
    end = tl.load(crow_ptr + row + 1)
    acc = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    for i in range(start, end, BLOCK_NNZ):
        idx = i + tl.arange(0, BLOCK_NNZ)
        mask = idx < end
        cols = tl.load(col_ptr + idx, mask=mask, other=0)
        vals = tl.load(val_ptr + idx, mask=mask, other=0.0).to(COMPUTE)
        xs = tl.load(
            x_ptr + cols[:, None] * N + offs_n[None, :],
            mask=mask[:, None] & mask_n[None, :],
            other=0.0,
        ).to(COMPUTE)
        acc += tl.sum(vals[:, None] * xs, axis=0)
    tl.store(y_ptr + row * N + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def ell_spmv_kernel(
    col_ptr,
    val_ptr,
    x_ptr,
    y_ptr,
    n_rows,
    W,
    COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    acc = tl.zeros((BLOCK_R,), dtype=COMPUTE)
    for w0 in range(0, W, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        mask = row_ok[:, None] & (slots[None, :] < W)
        offs = rows[:, None] * W + slots[None, :]
        cols = tl.load(col_ptr + offs, mask=mask, other=0)
        vals = tl.load(val_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        acc += tl.sum(vals * tl.load(x_ptr + cols, mask=mask, other=0.0).to(COMPUTE), axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def ell_spmm_kernel(
    col_ptr,
    val_ptr,
    x_ptr,
    y_ptr,
    W,
    N,
    COMPUTE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    for w0 in range(0, W, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        mask = slots < W
        cols = tl.load(col_ptr + row * W + slots, mask=mask, other=0)
        vals = tl.load(val_ptr + row * W + slots, mask=mask, other=0.0).to(COMPUTE)
        xs = tl.load(
            x_ptr + cols[:, None] * N + offs_n[None, :],
            mask=mask[:, None] & mask_n[None, :],
            other=0.0,
        ).to(COMPUTE)
        acc += tl.sum(vals[:, None] * xs, axis=0)
    tl.store(y_ptr + row * N + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
