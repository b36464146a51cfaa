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
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, mask_d,
               row_start, qk_scale, T_K, D, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               DOCS: tl.constexpr, COMPUTE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The online softmax over key tiles ``lo .. hi`` (see the module docstring). ``MASK``
    False: tiles every row of the query tile sees whole (below the causal diagonal, inside the
    keys), so no bounds, causal or document mask is built (the masks are most of the
    non-matmul work of a tile: FlashAttention and Triton's tutorial split the loop the same
    way). Rows past ``T_Q`` carry zeros and are never stored."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = mask_d[None, :]
        if MASK:
            kv_mask = (cols[:, None] < T_K) & kv_mask
        k = tl.load(k_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
        if MASK:
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
    return acc, l_i, m_i


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
    row_start = offs_m  # read only when DOCS
    mid = lo  # tiles in [lo, mid) need no mask; with documents, every tile is masked
    if DOCS:  # keys before the first row's document are masked for every row: skip them
        row_start = tl.load(start_ptr + (bh // N_HEADS) * T_Q + offs_m, mask=row_ok, other=T_K)
        lo = tl.min(row_start, axis=0)
        mid = lo
    else:  # whole tiles every row sees: all keys, or (causal) those before the tile's first row
        seen = T_K
        if CAUSAL:
            seen = tl.minimum(pid_m * BLOCK_M, T_K)
        mid = seen // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, lo, mid, offs_m, offs_n,
                               offs_d, mask_d, row_start, qk_scale, T_K, D, False, CAUSAL,
                               DOCS, COMPUTE, DOT_IN_FP32, PRECISION, BLOCK_N)  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, mid, hi, offs_m, offs_n,
                               offs_d, mask_d, row_start, qk_scale, T_K, D, True, CAUSAL,
                               DOCS, COMPUTE, DOT_IN_FP32, PRECISION, BLOCK_N)  # fmt: skip

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
def _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, bh, rows, offs_d, mask_d, T_Q, D,
                DOT_IN_FP32: tl.constexpr):  # fmt: skip
    """q, dO, lse and delta of query rows ``rows`` of head ``bh`` (zeros past ``T_Q``), and
    which rows exist: what both backward kernels read per query tile."""
    row_ok = rows < T_Q
    offs = bh * T_Q * D + rows[:, None] * D + offs_d[None, :]
    mask = row_ok[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0.0)
    do = tl.load(do_ptr + offs, mask=mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh * T_Q + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * T_Q + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta, row_ok


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bh, lo, hi, offs_m, offs_n,
                offs_d, mask_d, col_end, qk_scale, T_Q, T_K, D, MASK: tl.constexpr,
                CAUSAL: tl.constexpr, DOCS: tl.constexpr, COMPUTE: tl.constexpr,
                DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """dK and dV of one key tile over the query tiles ``lo .. hi`` of head ``bh``; ``MASK`` as
    in :func:`_fwd_tiles`. Unmasked, rows past ``T_Q`` (zero q, dO, lse and delta) add zero
    and keys past ``T_K`` are never stored."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q, do, lse, delta, row_ok = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, bh, rows,
                                                offs_d, mask_d, T_Q, D, DOT_IN_FP32)  # fmt: skip
        s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        if MASK:
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
    return dk, dv


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
    col_end = offs_n  # read only when DOCS
    if DOCS:  # queries after the last key's document never see this tile
        col_end = tl.load(
            end_ptr + (kv_bh * GROUP // N_HEADS) * T_K + offs_n, mask=offs_n < T_K, other=0
        )
        hi = tl.minimum(tl.max(col_end, axis=0), T_Q)
    # query tiles in [lo, mid) need the mask; those from mid on see every key of this tile
    # (their first row is at or past its last key), and rows past T_Q add zeros unmasked
    mid = lo
    if CAUSAL:
        last_key = (pid_n + 1) * BLOCK_N - 1
        mid = tl.minimum(lo + tl.cdiv(last_key - lo, BLOCK_M) * BLOCK_M, hi)
    if DOCS:
        mid = hi
    for g in range(0, GROUP):
        bh = kv_bh * GROUP + g  # the query heads that read this KV head
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bh, lo, mid,
                             offs_m, offs_n, offs_d, mask_d, col_end, qk_scale, T_Q, T_K, D,
                             True, CAUSAL, DOCS, COMPUTE, DOT_IN_FP32, PRECISION,
                             BLOCK_M)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bh, mid, hi,
                             offs_m, offs_n, offs_d, mask_d, col_end, qk_scale, T_Q, T_K, D,
                             False, CAUSAL, DOCS, COMPUTE, DOT_IN_FP32, PRECISION,
                             BLOCK_M)  # fmt: skip
    dk = dk * scale
    tl.store(dk_ptr + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_ptr, v_ptr, kv_bh, lo, hi, offs_m, offs_n, offs_d, mask_d,
              row_ok, row_start, qk_scale, T_K, D, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              DOCS: tl.constexpr, COMPUTE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """dQ over key tiles ``lo .. hi``; ``MASK`` as in :func:`_fwd_tiles` (rows past ``T_Q``
    have zero dO and delta, so their dS is zero unmasked too)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = mask_d[None, :]
        if MASK:
            kv_mask = (cols[:, None] < T_K) & kv_mask
        kv_offs = kv_bh * T_K * D + cols[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), out_dtype=COMPUTE, input_precision=PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        if MASK:
            keep = row_ok[:, None] & (cols[None, :] < T_K)
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            if DOCS:
                keep = keep & (cols[None, :] >= row_start[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), out_dtype=COMPUTE, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=COMPUTE, input_precision=PRECISION)
    return dq


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
    q, do, lse, delta, row_ok = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, bh, offs_m,
                                            offs_d, mask_d, T_Q, D, DOT_IN_FP32)  # fmt: skip
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=COMPUTE)
    qk_scale = scale * 1.4426950408889634

    lo = 0
    hi = T_K
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T_K)
    row_start = offs_m  # read only when DOCS
    mid = lo  # as in the forward: tiles in [lo, mid) need no mask
    if DOCS:
        row_start = tl.load(start_ptr + (bh // N_HEADS) * T_Q + offs_m, mask=row_ok, other=T_K)
        lo = tl.min(row_start, axis=0)
        mid = lo
    else:
        seen = T_K
        if CAUSAL:
            seen = tl.minimum(pid_m * BLOCK_M, T_K)
        mid = seen // BLOCK_N * BLOCK_N
    dq = _dq_tiles(dq, q, do, lse, delta, k_ptr, v_ptr, kv_bh, lo, mid, offs_m, offs_n, offs_d,
                   mask_d, row_ok, row_start, qk_scale, T_K, D, False, CAUSAL, DOCS, COMPUTE,
                   DOT_IN_FP32, PRECISION, BLOCK_N)  # fmt: skip
    dq = _dq_tiles(dq, q, do, lse, delta, k_ptr, v_ptr, kv_bh, mid, hi, offs_m, offs_n, offs_d,
                   mask_d, row_ok, row_start, qk_scale, T_K, D, True, CAUSAL, DOCS, COMPUTE,
                   DOT_IN_FP32, PRECISION, BLOCK_N)  # fmt: skip
    dq = dq * scale
    q_offs = bh * T_Q * D + offs_m[:, None] * D + offs_d[None, :]
    q_mask = row_ok[:, None] & mask_d[None, :]
    tl.store(dq_ptr + q_offs, dq.to(dq_ptr.dtype.element_ty), mask=q_mask)


def _tiles(shapes: list[tuple[int, int, int, int]]) -> list:
    """Autotuner configs from (BLOCK_M, BLOCK_N, stages, warps)."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
        for bm, bn, s, w in shapes
    ]


# The forward's tiles on a GPU.
FWD_TILES = [(128, 64, 3, 4), (128, 64, 4, 8), (128, 128, 3, 8), (64, 64, 4, 4), (64, 32, 4, 4)]
# The backward's: two (BLOCK, D) fp32 accumulators per program (dK and dV, or dQ and the loaded
# K/V), so smaller tiles than the forward; (64, 64) with 4 or 8 warps is what it ran with before
# it was tuned.
BWD_TILES = [(64, 64, 3, 4), (64, 64, 3, 8), (32, 64, 3, 4), (64, 32, 3, 4), (32, 128, 3, 8),
             (128, 32, 3, 8), (64, 128, 2, 8), (128, 64, 2, 8)]  # fmt: skip

_KEY = ["T_Q", "T_K", "D", "GROUP", "DOCS"]  # each autotuner below gets Config objects of its own
attn_fwd_kernel_autotuned = triton.autotune(_tiles(FWD_TILES), key=_KEY)(attn_fwd_kernel)
attn_bwd_dkdv_kernel_autotuned = triton.autotune(_tiles(BWD_TILES), key=_KEY)(attn_bwd_dkdv_kernel)
attn_bwd_dq_kernel_autotuned = triton.autotune(_tiles(BWD_TILES), key=_KEY)(attn_bwd_dq_kernel)
