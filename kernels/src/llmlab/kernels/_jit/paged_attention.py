"""Paged attention kernel: one program per (query row, query head), keys read through a block table.

The program knows its query's sequence and position (computed by the wrapper), and walks that
sequence's keys ``0 .. position`` one block (``BLOCK_SIZE`` slots) at a time: the block id comes
from the block table, the slot offsets inside the block are contiguous, so each step loads one
(BLOCK_SIZE, D) tile of keys and values. Scores are a row-vector product (a single query has
no M dimension for ``tl.dot``); the softmax is the online one of flash attention (running max
``m``, denominator ``l`` and unnormalised output ``acc``, rescaled by ``exp(m - m')`` when the
max grows), so no score vector of the whole context is ever stored.

Grouped-query attention: query head ``h`` reads KV head ``h // GROUP``.
"""

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,  # (N, H, D) contiguous
    k_ptr,  # (num_blocks, BLOCK_SIZE, H_kv, D)
    v_ptr,
    tables_ptr,  # (B, max_blocks)
    seq_ptr,  # (N,) sequence (row of the block table) of each query row
    pos_ptr,  # (N,) position of each query row in its sequence
    out_ptr,  # (N, H, D)
    scale,
    table_stride,
    block_stride,
    slot_stride,
    head_stride,
    D,
    GROUP,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    H = tl.num_programs(1)
    kv_head = head // GROUP
    seq = tl.load(seq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)
    mask_d = offs_d < D

    q = tl.load(q_ptr + (row * H + head) * D + offs_d, mask=mask_d, other=0.0).to(COMPUTE)
    qk_scale = scale * 1.4426950408889634  # exp(x) == exp2(x * log2(e))
    m_i = tl.full([], float("-inf"), dtype=COMPUTE)
    l_i = tl.zeros([], dtype=COMPUTE)
    acc = tl.zeros((BLOCK_D,), dtype=COMPUTE)
    for start in range(0, pos + 1, BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * table_stride + start // BLOCK_SIZE).to(tl.int64)
        keys_ok = start + offs_s <= pos
        offs = (
            block * block_stride
            + offs_s[:, None] * slot_stride
            + kv_head * head_stride
            + offs_d[None, :]
        )
        tile_ok = keys_ok[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + offs, mask=tile_ok, other=0.0).to(COMPUTE)
        v = tl.load(v_ptr + offs, mask=tile_ok, other=0.0).to(COMPUTE)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(keys_ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + (row * H + head) * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)
