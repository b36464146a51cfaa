"""Paged attention: attention whose keys and values live in fixed-size blocks of a shared pool.

A serving engine (``llmlab.serving``) keeps the KV cache of every running sequence in one pool
of ``num_blocks`` blocks of ``block_size`` token slots; a sequence owns a *block table*, the
list of its blocks in order, so token ``p`` of sequence ``b`` lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``. Nothing is contiguous per
sequence and nothing is reserved ahead: blocks are handed out as sequences grow (vLLM's
PagedAttention, Kwon et al., SOSP 2023).

The queries of one forward are *packed*: sequence ``b`` contributes ``n_b`` consecutive query
rows ``q[query_start[b] : query_start[b + 1]]`` (a prefill chunk, or one decode token), and its
``context_lens[b]`` keys -- the new tokens included, already written to the pool -- are
``0 .. context_lens[b] - 1``. Query ``j`` of sequence ``b`` is at position
``context_lens[b] - n_b + j`` and sees the keys up to and including its own position (causal),
the convention of FlashAttention's varlen API (``cu_seqlens_q``, ``seqused_k``).

Faces (DESIGN §3): :func:`reference` gathers each sequence's keys through its block table and
runs ``F.scaled_dot_product_attention`` (single-query sequences batched together, since decode
steps are the common case); the Triton kernel (``_jit/paged_attention.py``) runs one program per
(query, head) that walks the query's blocks with an online softmax and never gathers; and
:func:`paged_attention` dispatches between them. Grouped-query attention: the pool stores
``H_kv`` heads and query head ``h`` reads KV head ``h // (H / H_kv)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.kernels._runtime import (
    check_float,
    compute_dtype,
    jit_module,
    next_power_of_2,
    use_triton,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def slots(block_table: Tensor, length: int, block_size: int) -> Tensor:
    """Pool slot of each of the first ``length`` tokens of a sequence with ``block_table``."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def _gather(cache: Tensor, block_rows: Tensor, length: int) -> Tensor:
    """(..., length, H_kv, D): the first ``length`` tokens of the blocks ``block_rows`` (..., n)."""
    block_size = cache.shape[1]
    n = (length + block_size - 1) // block_size
    pages = cache[block_rows[..., :n].long()]  # (..., n, block_size, H_kv, D)
    return pages.flatten(-4, -3)[..., :length, :, :]


def reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
) -> Tensor:
    """(N, H, D) attention outputs for packed queries ``q`` (N, H, D); see the module docstring.

    ``k_cache``/``v_cache``: (num_blocks, block_size, H_kv, D); ``block_tables``: (B, max_blocks)
    block ids (entries past a sequence's last block are never read); ``query_start``: (B + 1,)
    offsets of each sequence's queries in ``q``; ``context_lens``: (B,) keys per sequence.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    starts = query_start.tolist()
    lens = context_lens.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    out = torch.empty_like(q)
    single = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if single:  # decode steps: one query per sequence, batched with a key-length mask
        rows = torch.tensor([starts[b] for b in single], device=q.device)
        tables = block_tables[torch.tensor(single, device=q.device)]
        longest = max(lens[b] for b in single)
        k = _gather(k_cache, tables, longest).transpose(1, 2)  # (S, H_kv, L, D)
        v = _gather(v_cache, tables, longest).transpose(1, 2)
        seen = torch.tensor([lens[b] for b in single], device=q.device)
        mask = None
        if len(single) > 1 and min(lens[b] for b in single) < longest:
            mask = (torch.arange(longest, device=q.device) < seen[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q[rows][:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[rows] = o[:, :, 0]
    for b in range(len(lens)):
        n = starts[b + 1] - starts[b]
        if n <= 1:
            continue
        L = lens[b]
        k = _gather(k_cache, block_tables[b], L).transpose(0, 1)[None]  # (1, H_kv, L, D)
        v = _gather(v_cache, block_tables[b], L).transpose(0, 1)[None]
        qb = q[starts[b] : starts[b + 1]].transpose(0, 1)[None]  # (1, H, n, D)
        # causal with the queries at the end: query j (position L - n + j) sees keys <= it
        keep = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
        out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1)
    return out


def triton_forward(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """The Triton kernel: one program per (query row, query head)."""
    N, H, D = q.shape
    _, block_size, H_kv, _ = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(
            f"paged_attention: the Triton kernel needs a power-of-two block_size, got {block_size}"
        )
    counts = query_start[1:] - query_start[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(counts), device=q.device), counts)
    # each row's position: its sequence's first new position plus its offset among the new rows
    first_new = (context_lens - counts)[seq_of_row]
    position = first_new + torch.arange(N, device=q.device) - query_start[:-1][seq_of_row]
    q = q.contiguous()
    out = torch.empty_like(q)
    jit_module("paged_attention").paged_attention_kernel[(N, H)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_of_row.to(torch.int32),
        position.to(torch.int32),
        out,
        scale,
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        D,
        H // H_kv,
        BLOCK_SIZE=block_size,
        BLOCK_D=max(16, next_power_of_2(D)),
        COMPUTE=compute_dtype(q.dtype),
    )
    return out


def _validate(q, k_cache, v_cache, block_tables, query_start, context_lens, scale) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float("paged_attention", name, t, DTYPES)
        if t.dtype != q.dtype:
            raise TypeError(
                f"paged_attention: {name} is {t.dtype} but q is {q.dtype}; they must match"
            )
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be (N, H, D), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} must be equal (num_blocks, block_size, H_kv, D)"
        )
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"paged_attention: q {tuple(q.shape)} and the cache {tuple(k_cache.shape)} must "
            f"agree on D, and the cache's {k_cache.shape[2]} KV heads must divide q's "
            f"{q.shape[1]} heads"
        )
    B = context_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != B or query_start.shape != (B + 1,):
        raise ValueError(
            f"paged_attention: block_tables {tuple(block_tables.shape)} must be (B, max_blocks) "
            f"and query_start {tuple(query_start.shape)} (B + 1,) for context_lens of B={B}"
        )
    if scale is not None and not scale > 0:
        raise ValueError(f"paged_attention: scale must be > 0 or None, got {scale!r}")


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Causal attention of packed queries over paged keys/values (see the module docstring).

    ``backend``: ``"auto"`` (the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else
    the reference, with one warning), ``"torch"`` (the reference, no warning: the intended path
    on a CPU) or ``"triton"`` (the kernel; an error where it cannot run). Inference only.
    """
    _validate(q, k_cache, v_cache, block_tables, query_start, context_lens, scale)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"paged_attention: backend={backend!r}; valid: auto, torch, triton")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k_cache, v_cache, block_tables, query_start, context_lens, scale)
    if backend == "torch" or q.shape[0] == 0:
        return reference(*args)
    if use_triton("paged_attention", q, k_cache, v_cache):
        return triton_forward(*args)
    if backend == "triton":
        raise RuntimeError(
            "paged_attention: backend='triton' needs CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return reference(*args)
