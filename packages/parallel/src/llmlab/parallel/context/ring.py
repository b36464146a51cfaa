"""Ring attention: exact attention over a sequence split across a context-parallel group.

Each of the ``N`` ranks holds a chunk of the queries, keys and values (its pieces of the
sequence, :mod:`~llmlab.parallel.context.layout`). Key/value chunks travel around the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r − 1``), so at step ``s`` rank ``r`` holds
the chunk of rank ``r − s``:

**Forward**, ``N`` steps: post the transfer of the held chunk to the right neighbour, compute
this rank's queries against it (:func:`~llmlab.parallel.context.layout.block_plan`: full
blocks, diagonal blocks, or nothing above the causal diagonal), merge the partial output by its
log-sum-exp (:func:`~llmlab.parallel.context.blocks.merge_into`), then wait for the next chunk:
the transfer runs while the compute does. Saved for backward: the local ``q, k, v``, the final
output and log-sum-exp, ``O(T/N)`` per rank; received chunks are dropped.

**Backward**, ``N`` steps again: the key/value chunks travel once more (re-sent rather than
kept, which would cost ``O(T)`` memory), and each rank adds its share of ``dK, dV`` for the
held chunk into a buffer that follows the chunk around the ring and arrives home after the
last step. The buffer starts at step 1 (the owner adds its own share at home), so a rank sends
``N − 1`` key/value chunks and ``N − 1`` gradient buffers; gradient buffers travel in the
accumulation dtype (fp32 for bf16) so the ``N`` shares are summed without bf16 rounding.

Grouped-query attention: only the ``H_kv`` key/value heads travel; the block kernels index the
shared heads. Bytes on the wire per rank, per layer and micro-batch, are
:func:`~llmlab.parallel.context.accounting.cp_bytes`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from llmlab.parallel.comm import CommStats, Peer
from llmlab.parallel.context.blocks import (
    accumulation_dtype,
    block_backward,
    block_forward,
    merge_into,
    resolve_backend,
)
from llmlab.parallel.context.layout import Block, ContextLayout, block_plan

# CommStats operation names: what each rank sends, by purpose.
KV_FORWARD = "context.kv_forward"
KV_BACKWARD = "context.kv_backward"
DKV_BACKWARD = "context.dkv_backward"


class _InFlight:
    """Transfers posted by :meth:`RingTransport.shift`; ``wait()`` returns the received tensors."""

    def __init__(
        self, works: list[dist.Work | None], received: list[Tensor], transport: RingTransport
    ) -> None:
        self.works, self.received, self.transport = works, received, transport

    def wait(self) -> list[Tensor]:
        """Idempotent: gloo's ``wait`` on a finished receive would wait for a second message."""
        start = time.perf_counter()
        for work in self.works:
            if work is not None:
                work.wait()
        if self.works:
            self.transport.waited_seconds += time.perf_counter() - start
        self.works = []
        return self.received


class RingTransport:
    """The point-to-point traffic of one context-parallel group, counted into ``stats`` by
    purpose (``KV_FORWARD``, ``KV_BACKWARD``, ``DKV_BACKWARD``).

    ``waited_seconds`` adds up the time spent blocked waiting for transfers: the communication
    that compute did *not* hide (with ``overlap=False``, all of it).
    """

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.peers = {
            op: Peer(group, self.stats, op) for op in (KV_FORWARD, KV_BACKWARD, DKV_BACKWARD)
        }
        any_peer = self.peers[KV_FORWARD]
        self.rank, self.size = any_peer.rank, any_peer.size
        self.waited_seconds = 0.0

    def shift(self, op: str, tensors: list[Tensor]) -> _InFlight:
        """Send ``tensors`` to the right neighbour and receive as many from the left, posted
        together (every rank posts the same sequence, so messages pair up in order)."""
        peer = self.peers[op]
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        received = [torch.empty_like(t) for t in tensors]
        works = [peer.isend(t.contiguous(), right) for t in tensors]
        works += [peer.irecv(buf, left) for buf in received]
        return _InFlight(works, received, self)


def _rows(t: Tensor, span: range) -> Tensor:
    """Rows ``span`` of the sequence dimension (dim 2 of (B, H, T, D) and of (B, H, T))."""
    return t[:, :, span.start : span.stop]


class RingAttention(torch.autograd.Function):
    """Autograd for :func:`ring_attention` (see the module docstring for the schedule)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        transport: RingTransport,
        layout: ContextLayout,
        backend: str,
        overlap: bool,
    ) -> Tensor:
        rank, n = transport.rank, transport.size
        seq_len = q.shape[2] * n
        acc = accumulation_dtype(q.dtype)
        k, v = k.contiguous(), v.contiguous()
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        held = [k, v]
        for step in range(n):
            incoming = transport.shift(KV_FORWARD, held) if step < n - 1 else None
            if incoming is not None and not overlap:
                incoming.wait()
            for block in block_plan(layout, rank, (rank - step) % n, seq_len, causal):
                block_out, block_lse = block_forward(
                    _rows(q, block.q), _rows(held[0], block.k), _rows(held[1], block.k),
                    block.diagonal, backend,
                )  # fmt: skip
                merge_into(_rows(out, block.q), _rows(lse, block.q), block_out, block_lse)
            if incoming is not None:
                held = incoming.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (causal, transport, layout, backend, overlap)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        causal, transport, layout, backend, overlap = ctx.setup
        rank, n = transport.rank, transport.size
        seq_len = q.shape[2] * n
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_home = dv_home = None
        held = [k, v]
        travelling: _InFlight | None = None  # the dK/dV buffer arriving from the left
        for step in range(n):
            incoming = transport.shift(KV_BACKWARD, held) if step < n - 1 else None
            if incoming is not None and not overlap:
                incoming.wait()
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            plan = block_plan(layout, rank, (rank - step) % n, seq_len, causal)
            _backward_blocks(plan, grad_out, q, held, out, lse, backend, dq, dk, dv)
            if step == 0:
                dk_home, dv_home = dk, dv
            else:
                if travelling is not None:  # the shares of the ranks this chunk visited before
                    dk_in, dv_in = travelling.wait()
                    dk.add_(dk_in)
                    dv.add_(dv_in)
                travelling = transport.shift(DKV_BACKWARD, [dk, dv])
                if not overlap:
                    travelling.wait()
            if incoming is not None:
                held = incoming.wait()
        if travelling is not None:  # this rank's own chunk, home with every other rank's share
            dk_in, dv_in = travelling.wait()
            dk_home.add_(dk_in)
            dv_home.add_(dv_in)
        grads = (dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype))
        return (*grads, None, None, None, None, None)


def _backward_blocks(
    plan: list[Block],
    grad_out: Tensor,
    q: Tensor,
    held: list[Tensor],
    out: Tensor,
    lse: Tensor,
    backend: str,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
) -> None:
    """Add each block's share of the gradients into ``dq`` and the held chunk's ``dk, dv``."""
    for block in plan:
        dq_b, dk_b, dv_b = block_backward(
            _rows(grad_out, block.q), _rows(q, block.q),
            _rows(held[0], block.k), _rows(held[1], block.k),
            _rows(out, block.q), _rows(lse, block.q), block.diagonal, backend,
        )  # fmt: skip
        _rows(dq, block.q).add_(dq_b)
        _rows(dk, block.k).add_(dk_b)
        _rows(dv, block.k).add_(dv_b)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    transport: RingTransport,
    layout: ContextLayout,
    causal: bool = True,
    backend: str = "auto",
    overlap: bool = True,
) -> Tensor:
    """Attention of this rank's queries over the *whole* sequence, which is split across the
    context group as ``layout`` says.

    ``q`` (B, H, T/N, D) and ``k, v`` (B, H_kv, T/N, D) are this rank's chunk (``H_kv``
    dividing ``H``: grouped-query attention). Equals ``F.scaled_dot_product_attention`` on the
    unsplit sequence, restricted to this rank's rows, in value and in gradients.
    ``overlap=False`` waits for each transfer before computing (to measure what overlap hides).
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"ring_attention wants q (B, H, T, D) and k, v (B, H_kv, T, D); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"ring_attention is self-attention over one split sequence: q {tuple(q.shape)} and "
            f"k {tuple(k.shape)} must agree on batch, local length and head dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention: {k.shape[1]} key/value heads do not divide {q.shape[1]} query "
            "heads (grouped-query attention needs whole groups)"
        )
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"ring_attention needs q, k, v of one float dtype; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")  # fmt: skip
    if layout.degree != transport.size:
        raise ValueError(
            f"layout is for {layout.degree} context ranks but the group has {transport.size}"
        )
    local = q.shape[2]
    per_rank = len(layout.pieces(0))
    if local % per_rank:
        raise ValueError(
            f"local sequence length {local} is not divisible by the {per_rank} pieces each rank "
            f"holds in the {layout.scheme} split"
        )
    backend = resolve_backend(backend, q.device)
    return RingAttention.apply(q, k, v, causal, transport, layout, backend, overlap)
