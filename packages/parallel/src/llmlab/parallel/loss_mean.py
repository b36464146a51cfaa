"""The loss of a global batch on any layout: every counted token weighs the same.

One process trains on ``L = Σ_t ℓ_t / N``: the sum of the token losses of the global batch over
``N``, its number of *counted* tokens (targets other than ``IGNORE_INDEX``: padding, prompt
tokens of a fine-tuning example, a masked document boundary). A layout splits those tokens over
``R`` ranks that each hold a different part and whose gradients are then averaged: data-parallel
replicas, and the context ranks that each hold a piece of every sequence (tensor and pipeline
ranks of one replica hold the *same* tokens and are not among them). Rank ``r`` computes the
mean ``m_r`` of its ``n_r`` counted tokens. The mean of the ``m_r`` is ``L`` only when every
``n_r`` is equal; in general it is not, and neither is the averaged gradient.

:func:`global_token_mean` fixes both with one all-reduce of two numbers per step
(``(n_r·m_r, n_r)``, as torchtitan and HF's ``num_items_in_batch`` do): its *value* is
``Σ_r n_r m_r / Σ_r n_r = L`` on every rank (so ``train/loss`` is the global batch's, whatever
the layout), and its *gradient* is ``R·n_r/N · ∂m_r``, so the strategy's usual mean over the
``R`` ranks gives ``Σ_r ∂(n_r m_r)/N = ∂L``: one process's gradient.

Which ranks are the ``R``: the strategy says, through ``loss_replicas`` (:class:`LossReplicas`);
Lightning's own data-parallel strategies (DDP, DeepSpeed, FSDP) average over the whole world.
Within a gradient-accumulation window each micro-batch's global mean weighs the same (Lightning
divides each by the window), as one process accumulating the same micro-batches does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100  # a target that is not counted (torch's cross-entropy default)


@dataclass(frozen=True)
class LossReplicas:
    """The ranks holding different tokens of one global batch whose gradients are averaged:
    ``group`` (``None``: the default group) of ``size`` ranks; ``size == 1``: this rank alone.
    ``row_shards``: under sequence parallelism, the tensor group, whose ranks each hold other
    rows of the same sequences between the tensor-parallel regions and *sum* the gradients of
    the weights replicated there (``None``: no such split). The token-mean loss never sees it
    (the head gathers the sequence first); a pooled sum over rows (:func:`replica_sum`) does."""

    group: Any = None
    size: int = 1
    row_shards: Any = None


@runtime_checkable
class SplitsTokens(Protocol):
    """A strategy that knows which ranks hold different tokens (the N-D strategy: data ×
    context; the parameter server: its workers)."""

    @property
    def loss_replicas(self) -> LossReplicas: ...


def loss_replicas(strategy: Any) -> LossReplicas:
    """The :class:`LossReplicas` of a Lightning strategy: its own answer where it has one, the
    whole world for Lightning's data-parallel strategies, else this rank alone."""
    if isinstance(strategy, SplitsTokens):
        return strategy.loss_replicas
    from lightning.pytorch.strategies import ParallelStrategy

    if isinstance(strategy, ParallelStrategy) and dist.is_initialized():
        return LossReplicas(None, dist.get_world_size())
    return LossReplicas()


def counted_tokens(targets: Tensor) -> Tensor:
    """How many targets count towards the loss (``int64``, on ``targets``' device)."""
    return (targets != IGNORE_INDEX).sum()


class _GlobalTokenMean(torch.autograd.Function):
    """Value: ``Σ n_r m_r / Σ n_r`` over the replicas. Gradient: ``size · n_r / N`` times
    ``m_r``'s own (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, local_mean: Tensor, count: Tensor, replicas: LossReplicas) -> Tensor:
        n = count.detach().to(device=local_mean.device, dtype=torch.float64)
        stats = torch.stack([local_mean.detach().to(torch.float64) * n, n])
        dist.all_reduce(stats, group=replicas.group)
        total = stats[1].clamp(min=1.0)
        ctx.scale = (replicas.size * n / total).to(local_mean.dtype)
        return (stats[0] / total).to(local_mean.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad * ctx.scale, None, None


def global_token_mean(local_mean: Tensor, count: Tensor, replicas: LossReplicas) -> Tensor:
    """The global batch's mean loss from this rank's mean over its ``count`` counted tokens
    (value: the global mean on every rank; gradient: this rank's share, see above). One rank:
    ``local_mean`` itself."""
    if replicas.size == 1:
        return local_mean
    return _GlobalTokenMean.apply(local_mean, count, replicas)


class _ReplicaSum(torch.autograd.Function):
    """Value: ``Σ_r x_r`` over the replicas (and the row shards). Gradient: ``size`` times the
    incoming one, so the strategy's mean over the replicas gives each ``x_r`` the gradient one
    process would; the row shards pass it on unchanged (their gradients are summed)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, replicas: LossReplicas) -> Tensor:
        ctx.size = replicas.size
        total = x.detach().clone()
        if replicas.size > 1:
            dist.all_reduce(total, group=replicas.group)
        if replicas.row_shards is not None:
            dist.all_reduce(total, group=replicas.row_shards)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.size, None


def replica_sum(x: Tensor, replicas: LossReplicas) -> Tensor:
    """``x`` summed over the loss replicas, differentiably, for a loss that is a function of
    sums over the whole global batch (a mixture of experts' load-balancing loss pools its
    router probabilities over every token): with every replica computing ``f(Σ_r x_r)``, the
    value is one process's and, after the strategy averages the gradients over the ``size``
    replicas, so is the gradient (each rank's ``x_r`` receives ``size · f'``, as in
    :func:`global_token_mean`). Under sequence parallelism the sum also runs over the row
    shards, whose ``x`` each receive ``size · f'`` too: sequence parallelism sums their
    gradients. One rank: ``x`` itself. Counts without a gradient go through the same call
    (their backward is never taken)."""
    if replicas.size == 1 and replicas.row_shards is None:
        return x
    return _ReplicaSum.apply(x, replicas)
