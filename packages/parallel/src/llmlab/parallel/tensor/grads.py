"""Gradient bookkeeping around a tensor-parallel model: data-parallel averaging and a global norm.

* ``average_data_parallel_grads``: with DP × TP each data-parallel replica holds the same shards,
  so gradients are averaged across the *data* group only (tensor-parallel ranks hold different
  shards and must not be mixed). One flat all-reduce, in a fixed parameter order.
* ``clip_grad_norm_``: the global norm of a sharded model counts each sharded parameter's slices
  once per rank (summed over the tensor group) and each replicated parameter once, so every rank
  clips by the same factor as a single process would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.tensor.collectives import Group, group_size
from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR


def average_data_parallel_grads(params: Iterable[nn.Parameter], group: Group) -> int:
    """Average ``.grad`` over the data-parallel ``group``; returns the bytes all-reduced."""
    n = group_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    if n == 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def grad_norm(params: Iterable[nn.Parameter], tensor_group: Group) -> Tensor:
    """The L2 norm of the full (unsharded) model's gradient; a collective over ``tensor_group``."""
    sharded, replicated = [], []
    for p in params:
        if p.grad is None:
            continue
        (sharded if hasattr(p, SHARD_DIM_ATTR) else replicated).append(p.grad.detach())
    zero = torch.zeros((), dtype=torch.float64)
    sq_sharded = sum((g.double().pow(2).sum() for g in sharded), zero.clone())
    sq_replicated = sum((g.double().pow(2).sum() for g in replicated), zero.clone())
    if group_size(tensor_group) > 1:
        dist.all_reduce(sq_sharded, group=tensor_group)
    return (sq_sharded + sq_replicated).sqrt()


def clip_grad_norm_(
    params: Iterable[nn.Parameter], max_norm: float, tensor_group: Group, eps: float = 1e-6
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model (same factor on all ranks)."""
    params = list(params)
    total = grad_norm(params, tensor_group)
    coef = (max_norm / (total + eps)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
