"""Memory-access demos: the same copy / transpose written with coalesced and strided access.

On a GPU a warp's 32 loads are merged into few memory transactions ("coalesced") only when the
lanes touch neighbouring addresses. ``copy_coalesced``: program p copies elements
``p*BLOCK + [0, BLOCK)``, neighbours in memory. ``copy_strided``: program p copies
``p + G*[0, BLOCK)`` (G = number of programs), so neighbouring lanes are G elements apart and
every load is its own transaction. Same bytes, same result, very different bandwidth.

``transpose_naive`` reads a row segment (coalesced) and writes it down a column (strided);
``transpose_tiled`` moves a square tile, which Triton stages through shared memory so that both
the global read and the global write are coalesced.
"""

import triton
import triton.language as tl


@triton.jit
def copy_coalesced_kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def copy_strided_kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    stride = tl.num_programs(0)
    offs = tl.program_id(0) + tl.arange(0, BLOCK) * stride
    mask = offs < n_elements
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def transpose_naive_kernel(x_ptr, y_ptr, M, N, BLOCK: tl.constexpr):
    """Program (row, chunk): read x[row, chunk] contiguously, write y[chunk, row] with stride M."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    vals = tl.load(x_ptr + row * N + cols, mask=mask)
    tl.store(y_ptr + cols * M + row, vals, mask=mask)


@triton.jit
def transpose_tiled_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask)
    # Store the transposed tile row-major into y (N, M): contiguous along y's rows.
    tl.store(
        y_ptr + cols[:, None] * M + rows[None, :],
        tl.trans(tile),
        mask=(cols[:, None] < N) & (rows[None, :] < M),
    )
