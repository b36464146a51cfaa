"""The three collectives tensor parallelism needs, along one tensor dimension, each recorded.

Thin wrappers over ``torch.distributed`` (gloo on CPU, NCCL on GPU) that never modify their input,
work along any dimension (last for hidden/vocab shards, 1 for the GPT's sequence), and append a
``CommRecord`` to the active ledger (:mod:`llmlab.parallel.tensor.accounting`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from llmlab.parallel.tensor.accounting import comm_ledger

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def check_divisible(size: int, n: int, what: str) -> None:
    if size % n != 0:
        raise ValueError(
            f"{what} has size {size}, which is not divisible by the tensor-parallel size {n}; "
            f"use a size that is a multiple of {n}"
        )


def all_reduce(x: Tensor, group: Group, tag: str = "", op: str = "sum") -> Tensor:
    """Sum (or max) of ``x`` over the group, returned as a new tensor."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.contiguous().clone()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(out, op=reduce_op, group=group)
    comm_ledger().add("all_reduce", _nbytes(out), n, tag)
    return out


def split(x: Tensor, group: Group, dim: int, what: str = "tensor") -> Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    check_divisible(x.shape[dim], n, f"{what} dimension {dim}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_gather(x: Tensor, group: Group, dim: int, tag: str = "") -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    out = torch.cat(parts, dim=dim)
    comm_ledger().add("all_gather", _nbytes(out), n, tag)
    return out


def reduce_scatter(
    x: Tensor, group: Group, dim: int, tag: str = "", what: str = "tensor"
) -> Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    check_divisible(x.shape[dim], n, f"{what} dimension {dim}")
    chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    comm_ledger().add("reduce_scatter", _nbytes(x), n, tag)
    return out
