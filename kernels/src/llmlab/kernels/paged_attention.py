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

That bookkeeping -- which slots each sequence's keys occupy, where each query sits -- is the
same for every layer of a forward, so it is computed once into a :class:`PagedLayout` and
handed to every layer's call.

Faces (docs/architecture.md#contracts): :func:`reference` gathers each sequence's keys through
its block table and runs ``F.scaled_dot_product_attention`` (single-query sequences batched
together, since decode steps are the common case); the Triton kernel
(``_jit/paged_attention.py``) runs one program per (query, head) that walks the query's blocks
with an online softmax and never gathers; and :func:`paged_attention` dispatches between them.
Grouped-query attention: the pool stores ``H_kv`` heads and query head ``h`` reads KV head
``h // (H / H_kv)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

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


class Scratch:
    """Memory lent to every call for the gathered keys and values, kept between calls.

    A gather writes a few MB per layer and step; into a fresh tensor, that is fresh pages the
    kernel must fault in and zero first (measured: 5x the copy itself, for 15 decodes of ~240
    tokens). A caller that runs many forwards (the serving engine) keeps one ``Scratch``.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def rows(self, name: str, n: int, like: Tensor) -> Tensor:
        """An (n, *like.shape[1:]) tensor of ``like``'s dtype and device, reused across calls."""
        key = (name, like.dtype, like.device)
        numel = n * like[0].numel()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(1.5 * (0 if buf is None else buf.numel()))),
                              dtype=like.dtype, device=like.device)  # fmt: skip
            self._buffers[key] = buf
        return buf[:numel].view(n, *like.shape[1:])


@dataclass(eq=False)
class PagedLayout:
    """Where one forward's queries and keys are: built once, read by every layer.

    ``block_tables``: (B, max_blocks) block ids (entries past a sequence's last block are
    never read); ``query_start``: (B + 1,) offsets of each sequence's queries in the packed
    batch; ``context_lens``: (B,) keys per sequence, the new ones included. The derived
    index tensors are computed on first use and then shared by all layers. ``scratch``: memory
    for the gathers, kept by the caller between forwards (None: fresh tensors).
    """

    block_tables: Tensor
    query_start: Tensor
    context_lens: Tensor
    block_size: int
    scratch: Scratch | None = None

    def __post_init__(self) -> None:
        B = self.context_lens.shape[0]
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != B:
            raise ValueError(
                f"PagedLayout: block_tables {tuple(self.block_tables.shape)} must be "
                f"(B, max_blocks) for context_lens of B={B}"
            )
        if self.query_start.shape != (B + 1,):
            raise ValueError(
                f"PagedLayout: query_start {tuple(self.query_start.shape)} must be (B + 1,) "
                f"= ({B + 1},) for context_lens of B={B}"
            )
        self.starts: list[int] = self.query_start.tolist()
        self.lens: list[int] = self.context_lens.tolist()
        counts = [b - a for a, b in zip(self.starts, self.starts[1:])]
        if any(n < 1 or n > L for n, L in zip(counts, self.lens)):
            raise ValueError(
                f"PagedLayout: each sequence needs 1 <= queries <= keys, got queries {counts} "
                f"for context_lens {self.lens}"
            )
        self.num_queries = self.starts[-1]
        self.decodes = [b for b, n in enumerate(counts) if n == 1]
        self.prefills = [b for b, n in enumerate(counts) if n > 1]

    def slots(self, seqs: list[int], length: int) -> Tensor:
        """(len(seqs) * length,) pool slots of the first ``length`` tokens of each sequence in
        ``seqs``, row after row (past a shorter sequence's end: some valid slot, to be masked)."""
        device = self.block_tables.device
        pos = torch.arange(length, device=device)
        tables = self.block_tables[torch.tensor(seqs, device=device)].long()
        return (
            tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
        ).flatten()

    def first_slot_if_contiguous(self, b: int) -> int | None:
        """The first slot of sequence ``b`` when its blocks are consecutive in the pool (then its
        keys are one slice of it, read without a gather), else None."""
        n = -(-self.lens[b] // self.block_size)
        table = self.table_rows[b][:n]
        if table == list(range(table[0], table[0] + n)):
            return table[0] * self.block_size
        return None

    @cached_property
    def table_rows(self) -> list[list[int]]:
        return self.block_tables.tolist()

    @cached_property
    def decode_groups(self) -> list[tuple[Tensor, Tensor | slice, Tensor | None]]:
        """The single-query sequences in groups of similar length, each read by one SDPA call:
        (query rows, where the keys are, key mask or None).

        One call over all of them would pad every sequence to the longest (measured: 4x the
        work for 20 decodes of 9 to 308 tokens); a new group starts when a sequence is under
        half the group's longest, so padding at most doubles a group's keys.
        """
        by_length = sorted(self.decodes, key=lambda b: -self.lens[b])
        groups: list[list[int]] = []
        for b in by_length:
            if groups and 2 * self.lens[b] >= self.lens[groups[-1][0]]:
                groups[-1].append(b)
            else:
                groups.append([b])
        out = []
        for group in groups:
            longest = self.lens[group[0]]
            group.sort()  # rows in batch order: one group of every row is the batch itself
            rows = torch.tensor([self.starts[b] for b in group], device=self.device)
            keys = self.key_index(group[0]) if len(group) == 1 else self.slots(group, longest)
            lens = [self.lens[b] for b in group]
            mask = None
            if min(lens) < longest:
                seen = torch.tensor(lens, device=self.device)
                mask = (torch.arange(longest, device=self.device) < seen[:, None])[:, None, None]
            out.append((rows, keys, mask))
        return out

    @cached_property
    def prefill_parts(self) -> list[tuple[int, int, Tensor | slice, Tensor]]:
        """Per multi-query sequence: its query rows, where its keys are (slots, or one slice of
        the pool) and its causal mask (query ``j`` is at position ``L - n + j`` and sees the keys
        up to it)."""
        parts = []
        for b in self.prefills:
            start, end, L = self.starts[b], self.starts[b + 1], self.lens[b]
            keep = torch.ones(end - start, L, dtype=torch.bool, device=self.device)
            parts.append((start, end, self.key_index(b), keep.tril(L - (end - start))))
        return parts

    def key_index(self, b: int) -> Tensor | slice:
        first = self.first_slot_if_contiguous(b)
        if first is not None:
            return slice(first, first + self.lens[b])
        return self.slots([b], self.lens[b])

    @cached_property
    def row_seq_and_pos(self) -> tuple[Tensor, Tensor]:
        """(N,) int32 sequence and position of every query row (the Triton kernel's input)."""
        seq, pos = [], []
        for b, (a, e) in enumerate(zip(self.starts, self.starts[1:])):
            seq += [b] * (e - a)
            pos += range(self.lens[b] - (e - a), self.lens[b])
        return (torch.tensor(seq, dtype=torch.int32, device=self.device),
                torch.tensor(pos, dtype=torch.int32, device=self.device))  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.block_tables.device


def _read(pool: Tensor, where: Tensor | slice, scratch: Scratch | None, name: str) -> Tensor:
    """Rows ``where`` of a flattened (slots, H_kv, D) pool: a view for a slice, else a gather
    (into ``scratch`` when there is one)."""
    if isinstance(where, slice):
        return pool[where]
    if scratch is None:
        return pool.index_select(0, where)
    return torch.index_select(pool, 0, where, out=scratch.rows(name, where.numel(), pool))


def _attend_decodes(q: Tensor, keys: Tensor, values: Tensor, rows: Tensor,
                    where: Tensor | slice, mask: Tensor | None, scratch: Scratch | None,
                    scale: float, gqa: bool) -> Tensor:  # fmt: skip
    """One SDPA call for single-query sequences ``q`` (S, H, D) over padded, masked keys."""
    S, heads, dim = rows.numel(), keys.shape[1], keys.shape[2]
    k = _read(keys, where, scratch, "k").view(S, -1, heads, dim).transpose(1, 2)
    v = _read(values, where, scratch, "v").view(S, -1, heads, dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=gqa)  # fmt: skip
    return o[:, :, 0]


def reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: PagedLayout, scale: float | None = None
) -> Tensor:
    """(N, H, D) attention outputs for packed queries ``q`` (N, H, D) over the pool
    ``k_cache``/``v_cache`` (num_blocks, block_size, H_kv, D); see the module docstring."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    keys, values = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    gqa = q.shape[1] != heads
    groups = layout.decode_groups
    if len(groups) == 1 and not layout.prefills:  # one call: its rows are the batch, in order
        return _attend_decodes(q, keys, values, *groups[0], layout.scratch, scale, gqa)
    out = torch.empty_like(q)
    for rows, where, mask in groups:
        out[rows] = _attend_decodes(q[rows], keys, values, rows, where, mask, layout.scratch,
                                    scale, gqa)  # fmt: skip
    for start, end, where, keep in layout.prefill_parts:
        k = _read(keys, where, layout.scratch, "k").transpose(0, 1)[None]  # (1, H_kv, L, D)
        v = _read(values, where, layout.scratch, "v").transpose(0, 1)[None]
        qb = q[start:end].transpose(0, 1)[None]  # (1, H, n, D)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def triton_forward(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: PagedLayout, scale: float
) -> Tensor:
    """The Triton kernel: one program per (query row, query head)."""
    N, H, D = q.shape
    _, block_size, H_kv, _ = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(
            f"paged_attention: the Triton kernel needs a power-of-two block_size, got {block_size}"
        )
    row_seq, row_pos = layout.row_seq_and_pos
    q = q.contiguous()
    out = torch.empty_like(q)
    jit_module("paged_attention").paged_attention_kernel[(N, H)](
        q,
        k_cache,
        v_cache,
        layout.block_tables,
        row_seq,
        row_pos,
        out,
        scale,
        layout.block_tables.stride(0),
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


def _validate(q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: PagedLayout, scale) -> None:
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
    if k_cache.shape[1] != layout.block_size or q.shape[0] != layout.num_queries:
        raise ValueError(
            f"paged_attention: the layout has block_size {layout.block_size} and "
            f"{layout.num_queries} queries; the cache has blocks of {k_cache.shape[1]} and q "
            f"{q.shape[0]} rows"
        )
    if scale is not None and not scale > 0:
        raise ValueError(f"paged_attention: scale must be > 0 or None, got {scale!r}")


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    layout: PagedLayout,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Causal attention of packed queries over paged keys/values (see the module docstring).

    ``backend``: ``"auto"`` (the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else
    the reference, with one warning), ``"torch"`` (the reference, no warning: the intended path
    on a CPU) or ``"triton"`` (the kernel; an error where it cannot run). Inference only.
    """
    _validate(q, k_cache, v_cache, layout, scale)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"paged_attention: backend={backend!r}; valid: auto, torch, triton")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if backend == "torch":
        return reference(q, k_cache, v_cache, layout, scale)
    if use_triton("paged_attention", q, k_cache, v_cache):
        return triton_forward(q, k_cache, v_cache, layout, scale)
    if backend == "triton":
        raise RuntimeError(
            "paged_attention: backend='triton' needs CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return reference(q, k_cache, v_cache, layout, scale)
