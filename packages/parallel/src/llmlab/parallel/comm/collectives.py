"""Collectives built only from point-to-point messages (``Peer.send/recv/isend/irecv``).

Each works for any tensor size (chunks may be uneven or empty) and any group size, odd ones
included, and counts the bytes this rank sends into an optional ``CommStats``. Results are
identical on every rank (each element is reduced once, in a fixed order, then copied), so they
can replace ``torch.distributed`` collectives in data-parallel training without ranks drifting.
Every buffer they allocate takes the input's device and dtype (``new_empty``/``empty_like``), so
they run on CUDA tensors over NCCL as on CPU tensors over gloo.

    ring all-reduce         reduce-scatter then all-gather around a ring: 2(p-1) steps, each rank
                            sends 2(p-1)/p·n elements (bandwidth-optimal, latency ∝ p)
    recursive doubling      log2(p) pairwise swaps of the whole vector (latency-optimal; a
                            non-power-of-two p folds the extra ranks in first and out at the end)
    reduce-then-broadcast   binomial-tree reduce to rank 0, then binomial-tree broadcast
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from llmlab.parallel.comm.chunks import chunk_bounds
from llmlab.parallel.comm.p2p import CommStats, Peer

Combine = Callable[[torch.Tensor, torch.Tensor], None]

_COMBINE: dict[str, Combine] = {
    "sum": lambda acc, x: acc.add_(x),
    "product": lambda acc, x: acc.mul_(x),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}
_FROM_REDUCE_OP = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
}


def _combine_for(op: str | dist.ReduceOp) -> Combine:
    name = _FROM_REDUCE_OP.get(op, op) if not isinstance(op, str) else op
    if name not in _COMBINE:
        raise ValueError(f"unsupported reduce op {op!r}; valid: {sorted(_COMBINE)}")
    return _COMBINE[name]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("collectives work in place on contiguous tensors; call .contiguous()")
    return tensor.view(-1)


# --------------------------------------------------------------------------- ring building blocks


def _ring_reduce_scatter_(
    flat: torch.Tensor, bounds: list[tuple[int, int]], peer: Peer, combine: Combine
) -> None:
    """After this, chunk ``r`` of ``flat`` on rank ``r`` holds the reduction over all ranks.

    Step s: send chunk (r-s-1) to the right neighbour, receive chunk (r-s-2) from the left and
    fold it in; after p-1 steps the chunk that arrived last is rank r's own, fully reduced.
    """
    p, r = peer.size, peer.rank
    right, left = (r + 1) % p, (r - 1) % p
    largest = max(stop - start for start, stop in bounds)
    scratch = flat.new_empty(largest)  # the input's device and dtype: CUDA stays on CUDA
    for s in range(p - 1):
        send_i, recv_i = (r - s - 1) % p, (r - s - 2) % p
        s0, s1 = bounds[send_i]
        r0, r1 = bounds[recv_i]
        incoming = scratch[: r1 - r0]
        peer.exchange(flat[s0:s1], right, incoming, left)
        combine(flat[r0:r1], incoming)


def _ring_all_gather_(flat: torch.Tensor, bounds: list[tuple[int, int]], peer: Peer) -> None:
    """Rank r holds chunk r; after p-1 steps of pass-it-right every rank holds every chunk."""
    p, r = peer.size, peer.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_i, recv_i = (r - s) % p, (r - s - 1) % p
        s0, s1 = bounds[send_i]
        r0, r1 = bounds[recv_i]
        peer.exchange(flat[s0:s1], right, flat[r0:r1], left)


# --------------------------------------------------------------------------- all-reduce


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """In-place ring all-reduce: reduce-scatter then all-gather over p uneven chunks."""
    combine = _combine_for(op)
    peer = Peer(group, stats, "ring_all_reduce")
    flat = _flat(tensor)
    if peer.size == 1 or flat.numel() == 0:
        return tensor
    bounds = chunk_bounds(flat.numel(), peer.size)
    _ring_reduce_scatter_(flat, bounds, peer, combine)
    _ring_all_gather_(flat, bounds, peer)
    return tensor


def _fold_into(
    acc: torch.Tensor, other: torch.Tensor, acc_is_lower: bool, combine: Combine
) -> None:
    """acc ← lower ∘ higher, so both partners of a swap compute the very same floating-point op."""
    if acc_is_lower:
        combine(acc, other)
    else:
        combine(other, acc)
        acc.copy_(other)


def recursive_doubling_all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """In-place recursive-doubling all-reduce (the butterfly of a hypercube).

    With q = 2^⌊log2 p⌋: ranks q..p-1 first hand their vector to rank r-q, the q ranks swap
    whole vectors with partner r XOR 2^k for k = 0..log2(q)-1, and the result goes back out.
    """
    combine = _combine_for(op)
    peer = Peer(group, stats, "recursive_doubling_all_reduce")
    flat = _flat(tensor)
    p, r = peer.size, peer.rank
    if p == 1 or flat.numel() == 0:
        return tensor
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    if r >= q:  # folded-in rank: contribute, then wait for the answer
        peer.send(flat, r - q)
        peer.recv(flat, r - q)
        return tensor
    incoming = torch.empty_like(flat)
    if r < extra:
        peer.recv(incoming, r + q)
        combine(flat, incoming)
    mask = 1
    while mask < q:
        partner = r ^ mask
        peer.exchange(flat, partner, incoming, partner)
        _fold_into(flat, incoming, r < partner, combine)
        mask <<= 1
    if r < extra:
        peer.send(flat, r + q)
    return tensor


def reduce_broadcast_all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """In-place all-reduce as a binomial-tree reduce to rank 0 followed by a tree broadcast."""
    reduce(tensor, dst=0, op=op, group=group, stats=stats)
    broadcast(tensor, src=0, group=group, stats=stats)
    return tensor


ALL_REDUCE_ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
}


def all_reduce(
    tensor: torch.Tensor,
    algorithm: str = "ring",
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Dispatch to one of ``ALL_REDUCE_ALGORITHMS`` (in place, like ``dist.all_reduce``)."""
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; valid: {sorted(ALL_REDUCE_ALGORITHMS)}"
        )
    return ALL_REDUCE_ALGORITHMS[algorithm](tensor, op=op, group=group, stats=stats)


# ----------------------------------------------------------------- tree reduce / broadcast


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Binomial-tree reduce onto group rank ``dst`` (in place there; others' buffers are scratch).

    In relative rank v = (r - dst) mod p, round k pairs v with v + 2^k for v a multiple of
    2^(k+1): ⌈log2 p⌉ rounds, every non-root rank sends its partial sum exactly once.
    """
    combine = _combine_for(op)
    peer = Peer(group, stats, "reduce")
    _check_root(dst, peer.size, "dst")
    flat = _flat(tensor)
    p = peer.size
    v = (peer.rank - dst) % p
    incoming = torch.empty_like(flat)
    mask = 1
    while mask < p:
        if v & mask:
            peer.send(flat, (v - mask + dst) % p)
            break
        if v + mask < p:
            peer.recv(incoming, (v + mask + dst) % p)
            combine(flat, incoming)
        mask <<= 1
    return tensor


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Binomial-tree broadcast from group rank ``src``: the set of ranks holding the data
    doubles each round, so ⌈log2 p⌉ rounds and p-1 messages in total."""
    peer = Peer(group, stats, "broadcast")
    _check_root(src, peer.size, "src")
    flat = _flat(tensor)
    p = peer.size
    v = (peer.rank - src) % p
    mask = 1
    while mask < p:  # find my parent: the lowest set bit of v
        if v & mask:
            peer.recv(flat, (v - mask + src) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            peer.send(flat, (v + mask + src) % p)
        mask >>= 1
    return tensor


def _check_root(root: int, size: int, name: str) -> None:
    if not 0 <= root < size:
        raise ValueError(f"{name}={root} is not a rank of this group; valid: 0..{size - 1}")


# --------------------------------------------------------------------------- gather / scatter


def all_gather(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Ring all-gather: returns a new tensor of shape (p, *tensor.shape), row i from rank i."""
    peer = Peer(group, stats, "all_gather")
    m = tensor.numel()
    out = tensor.new_empty((peer.size, *tensor.shape))
    flat = out.view(-1)
    r = peer.rank
    flat[r * m : (r + 1) * m].copy_(tensor.reshape(-1))
    if peer.size > 1 and m > 0:
        _ring_all_gather_(flat, [(i * m, (i + 1) * m) for i in range(peer.size)], peer)
    return out


def reduce_scatter(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Ring reduce-scatter of the flattened ``tensor``: returns this rank's chunk of the
    reduction (chunk sizes from ``chunk_bounds``, so the first n % p ranks get one extra).

    ``tensor`` is left untouched (the ring works on a copy).
    """
    combine = _combine_for(op)
    peer = Peer(group, stats, "reduce_scatter")
    flat = tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), peer.size)
    if peer.size > 1 and flat.numel() > 0:
        _ring_reduce_scatter_(flat, bounds, peer, combine)
    start, stop = bounds[peer.rank]
    return flat[start:stop].clone()
