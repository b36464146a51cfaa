"""Flash attention (forward and backward) for q, k, v laid out as (B*H, T, D) contiguous.

Forward (one program per BLOCK_M queries of one head): stream BLOCK_N keys/values at a time and
keep, per query row, the running max ``m``, the running denominator ``l`` and the unnormalised
output ``acc``. When a new tile raises the max from ``m`` to ``m'``, old terms are rescaled by
``exp(m - m')`` (the online softmax), so the T x T probability matrix never exists in memory.
Saved for the backward: the output and ``lse = m + log(l)``, one float per query row.
Scores use ``exp2`` with ``log2(e)`` folded into the scale (one multiply, the fast unit).

Backward (FlashAttention-2): probabilities are recomputed from q, k and ``lse`` as
``p = exp(q.k * scale - lse)``. With ``delta_i = sum_d dO_i * O_i``:
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ = dS K * scale``,
``dK = dS^T Q * scale``. One kernel owns a K/V tile and sweeps the queries (dK, dV); another
owns a Q tile and sweeps the keys (dQ): no atomics, each output written once.

Grouped-query attention (GQA): q has ``GROUP`` times as many heads as k and v. Query head
``bh = b·H + h`` reads KV head ``bh // GROUP`` (= ``b·H_kv + h // GROUP``, because ``H`` is a
multiple of ``GROUP``), so the shared K/V are indexed, never repeated in memory. The dK/dV
kernel owns a tile of one KV head and sweeps the queries of all ``GROUP`` heads that read it,
so the group's gradients are summed in registers, still without atomics.

Document masking (``DOCS``): a packed row holds several documents one after another, and a query
may see only the keys of its own document. Documents are contiguous, so "same document and
causal" is an interval: query ``i`` sees keys ``[start_i, i]`` and key ``j`` is seen by queries
``[j, end_j)``, with ``start`` / ``end`` the (B, T) first index and end of each token's document.
The interval also bounds the loops: a query tile starts at its first row's document start, and a
key tile's sweep stops at its last key's document end, so the work is ``Σ len(doc)²``, not
``T²`` (what FlashAttention's variable-length kernels save).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    scale,
    T_Q,
    T_K,
    D,
    GROUP,  # query heads per KV head (1: multi-head attention)
    start_ptr,  # (B, T) int32: first index of each token's document (read when DOCS)
    N_HEADS,  # query heads per batch row: bh // N_HEADS is the row
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision, see _runtime.dot_precision
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = bh // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + bh * T_Q * D
    k_base = k_ptr + kv_bh * T_K * D
    v_base = v_ptr + kv_bh * T_K * D
    mask_d = offs_d < D
    row_ok = offs_m < T_Q

    q = tl.load(
        q_base + offs_m[:, None] * D + offs_d[None, :],
        mask=(offs_m[:, None] < T_Q) & mask_d[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # fold log2(e): exp(x) == exp2(x * log2(e))

    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=COMPUTE)
    l_i = tl.zeros((BLOCK_M,), dtype=COMPUTE)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=COMPUTE)

    lo = 0
    hi = T_K
    if CAUSAL:  # keys after the tile's last query are masked for every row: skip them
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T_K)
    if DOCS:  # keys before the first row's document are masked for every row: skip them
        row_start = tl.load(start_ptr + (bh // N_HEADS) * T_Q + offs_m, mask=row_ok, other=T_K)
        lo = tl.min(row_start, axis=0)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < T_K) & mask_d[None, :]
        k = tl.load(k_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
        keep = cols[None, :] < T_K
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if DOCS:
            keep = keep & (cols[None, :] >= row_start[:, None])
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if DOCS:  # a row may have seen no key yet (its document starts later): shift by 0
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, out_dtype=COMPUTE, input_precision=PRECISION
        )
        m_i = m_new

    if DOCS:  # rows past the end saw no key at all; they are not stored, but avoid 0 / 0
        l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + bh * T_Q * D + offs_m[:, None] * D + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & mask_d[None, :],
    )
    # lse in natural-log units: (m + log2 l) * ln 2, with m already in log2 units.
    tl.store(lse_ptr + bh * T_Q + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    scale,
    T_Q,
    T_K,
    D,
    GROUP,  # query heads per KV head: this program sums the dK/dV of all of them
    end_ptr,  # (B, T) int32: end (exclusive) of each token's document (read when DOCS)
    N_HEADS,  # query heads per batch row
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision, see _runtime.dot_precision
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    kv_bh = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    kv_mask = (offs_n[:, None] < T_K) & mask_d[None, :]
    kv_offs = kv_bh * T_K * D + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=COMPUTE)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=COMPUTE)
    qk_scale = scale * 1.4426950408889634

    lo = 0
    if CAUSAL:  # queries before this key tile's first key never see it
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    hi = T_Q
    if DOCS:  # queries after the last key's document never see this tile
        col_end = tl.load(
            end_ptr + (kv_bh * GROUP // N_HEADS) * T_K + offs_n, mask=offs_n < T_K, other=0
        )
        hi = tl.minimum(tl.max(col_end, axis=0), T_Q)
    for g in range(0, GROUP):
        bh = kv_bh * GROUP + g  # the query heads that read this KV head
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < T_Q
            q_offs = bh * T_Q * D + rows[:, None] * D + offs_d[None, :]
            q_mask = row_ok[:, None] & mask_d[None, :]
            q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
            do = tl.load(do_ptr + q_offs, mask=q_mask, other=0.0)
            if DOT_IN_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + bh * T_Q + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + bh * T_Q + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
            p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
            keep = row_ok[:, None] & (offs_n[None, :] < T_K)
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= rows[:, None])
            if DOCS:
                keep = keep & (rows[:, None] < col_end[None, :])
            p = tl.where(keep, p, 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, out_dtype=COMPUTE, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), out_dtype=COMPUTE, input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, out_dtype=COMPUTE, input_precision=PRECISION)
    dk = dk * scale
    tl.store(dk_ptr + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    scale,
    T_Q,
    T_K,
    D,
    GROUP,  # query heads per KV head
    start_ptr,  # (B, T) int32: first index of each token's document (read when DOCS)
    N_HEADS,  # query heads per batch row
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision, see _runtime.dot_precision
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = bh // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    row_ok = offs_m < T_Q
    q_offs = bh * T_Q * D + offs_m[:, None] * D + offs_d[None, :]
    q_mask = row_ok[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_offs, mask=q_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh * T_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * T_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=COMPUTE)
    qk_scale = scale * 1.4426950408889634

    lo = 0
    hi = T_K
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T_K)
    if DOCS:
        row_start = tl.load(start_ptr + (bh // N_HEADS) * T_Q + offs_m, mask=row_ok, other=T_K)
        lo = tl.min(row_start, axis=0)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < T_K) & mask_d[None, :]
        kv_offs = kv_bh * T_K * D + cols[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        keep = row_ok[:, None] & (cols[None, :] < T_K)
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if DOCS:
            keep = keep & (cols[None, :] >= row_start[:, None])
        p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), out_dtype=COMPUTE, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=COMPUTE, input_precision=PRECISION)
    dq = dq * scale
    tl.store(dq_ptr + q_offs, dq.to(dq_ptr.dtype.element_ty), mask=q_mask)


def gpu_configs() -> list:
    """(BLOCK_M, BLOCK_N, stages, warps) tried by the autotuner on a GPU."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
        for bm, bn, s, w in [
            (128, 64, 3, 4),
            (128, 64, 4, 8),
            (128, 128, 3, 8),
            (64, 64, 4, 4),
            (64, 32, 4, 4),
        ]
    ]


attn_fwd_kernel_autotuned = triton.autotune(
    configs=gpu_configs(), key=["T_Q", "T_K", "D", "GROUP", "DOCS"]
)(attn_fwd_kernel)
