"""The gradient norm of the whole model, from whatever pieces of it this rank holds.

Every layout splits the model differently: tensor parallelism shards a weight across the tensor
group but *replicates* norms and biases there; pipeline parallelism puts layers on different
stages and keeps a copy of a tied weight (GPT's embedding = LM head) on two of them; ZeRO cuts the
flat gradient into data-parallel shards. The single-process norm counts each parameter once, so
each piece gets a weight -- the share of its parameter it stands for -- and one sum over the
groups that split the model gives the same number on every rank:

    ‖g‖² = Σ_groups Σ_pieces w · ‖piece‖²,   w = 1 for a shard, 1/n for a copy held by n ranks
                                               of a summed group, 0 for a tied duplicate.

Weights are exact powers of two for n = 2, 4, 8, so the sum is as exact as the single-process one.

:func:`global_grad_norm` is the one gradient norm of the project: the N-D strategy (through
:class:`WholeModelNorm`), the ZeRO engine's clipping, the parameter server and the telemetry
callback's ``train/grad_norm`` all compute it here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR


def piece_weights(
    params: Sequence[nn.Parameter], tensor_size: int, duplicates: Iterable[nn.Parameter] = ()
) -> list[float]:
    """The weight of each parameter of this rank in a norm summed over the tensor group.

    A tensor-parallel shard stands for itself (1); a parameter replicated on the ``tensor_size``
    ranks of the tensor group for a ``1/tensor_size`` share; a copy of a tied weight held by a
    stage that does not own it for nothing (0).
    """
    skip = {id(p) for p in duplicates}
    weights = []
    for p in params:
        if id(p) in skip:
            weights.append(0.0)
        elif hasattr(p, SHARD_DIM_ATTR):
            weights.append(1.0)
        else:
            weights.append(1.0 / tensor_size)
    return weights


def global_grad_norm(
    grads: Sequence[Tensor | None],
    weights: Sequence[float],
    groups: Iterable[dist.ProcessGroup | None] = (),
    norm_type: float = 2.0,
) -> Tensor:
    """The norm of the whole model's gradient (a collective over every group in ``groups``).

    ``grads[i]`` is this rank's piece with weight ``weights[i]`` (``None``: no gradient, skipped);
    ``groups``: the groups whose ranks hold different pieces (tensor, pipeline, data under ZeRO),
    each summed once. Every rank gets the same value. A ``DTensor`` gradient (FSDP2) counts by
    its local shard, as a ZeRO piece does.
    """
    groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
    present = [
        (local_tensor(g), w) for g, w in zip(grads, weights, strict=True) if g is not None and w > 0
    ]
    device = present[0][0].device if present else _device_of(grads)
    # The norm comes back in fp32, or fp64 for fp64 gradients: rounding an fp64 model's norm to
    # fp32 would round its clip coefficient, which a single-process run does not.
    dtype = torch.float64 if any(g.dtype == torch.float64 for g, _ in present) else torch.float32
    if norm_type == float("inf"):
        local = torch.zeros((), device=device, dtype=torch.float64)  # the same on every rank
        for g, _ in present:
            local = torch.maximum(local, g.detach().abs().max().double())
        for group in groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local.to(dtype)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for g, w in present:
        total += w * g.detach().double().norm(norm_type) ** norm_type
    for group in groups:
        dist.all_reduce(total, group=group)
    return (total ** (1.0 / norm_type)).to(dtype)


def clip_by_total_norm_(grads: Iterable[Tensor | None], total: Tensor, max_norm: float) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))``, as ``clip_grad_norm_`` does."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            local_tensor(g).detach().mul_(coef.to(g.device, g.dtype))


def local_tensor(t: Tensor) -> Tensor:
    """What this rank holds of ``t``: a ``DTensor``'s local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _device_of(grads: Sequence[Tensor | None]) -> torch.device:
    return next((g.device for g in grads if g is not None), torch.device("cpu"))


class WholeModelNorm:
    """The whole model's gradient norm in one layout, from what this rank's optimizer steps.

    ``tensor_size``: the tensor-parallel degree (replicated parameters count ``1/tensor_size``);
    ``groups``: the groups whose ranks hold different pieces (tensor, pipeline, and data under
    ZeRO); ``duplicates``: tied copies another stage owns; ``owner_of``: ``id(optimizer
    tensor) -> model parameter`` for fp32 masters or ZeRO pieces, asked at each call (it is
    built after the optimizers are).
    """

    def __init__(
        self,
        tensor_size: int,
        groups: Iterable[dist.ProcessGroup | None],
        duplicates: Iterable[nn.Parameter] = (),
        owner_of: Callable[[], Mapping[int, nn.Parameter]] = dict,
        experts: Iterable[nn.Parameter] = (),
        expert_size: int = 1,
        expert_weight: float = 1.0,
    ) -> None:
        self.tensor_size = tensor_size
        self.groups = list(groups)
        self.duplicates = list(duplicates)
        self.owner_of = owner_of
        self.experts = {id(p) for p in experts}  # expert slices: summed over the expert group,
        self.expert_size = expert_size  # in ``groups``; every other piece counts 1/expert_size
        self.expert_weight = expert_weight  # an expert slice's weight (its copies in ``groups``)

    def __call__(self, params: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
        """The norm of ``params``' gradients as the whole model's (a collective)."""
        params = list(params)
        owner = self.owner_of()
        owners = [owner.get(id(p), p) for p in params]
        weights = piece_weights(owners, self.tensor_size, self.duplicates)
        if self.expert_size > 1:
            weights = [w * self.expert_weight if id(p) in self.experts else w / self.expert_size
                       for p, w in zip(owners, weights, strict=True)]  # fmt: skip
        return global_grad_norm([p.grad for p in params], weights, self.groups, norm_type)
