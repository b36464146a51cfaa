"""Gradient bookkeeping across stages: tied weights, data parallelism, the global norm.

Tied weights: GPT ties its input embedding to its LM head. When those layers land on different
stages, each stage holds a copy of the one weight and computes half of its gradient, so the two
halves are summed across the stages that hold it (Megatron-LM's embedding group) -- then both
copies take the same optimizer step and stay equal, and the gradient equals single-process.

Data parallelism: each data-parallel replica of a stage saw its share of the global batch, and
the loss is a mean, so its gradients are averaged within the stage's data-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn


def find_tied_parameters(layers: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters shared between layers, as groups of (layer index, parameter name).

    Found by object identity on the full model, before it is cut, so every rank finds the same
    groups in the same order.
    """
    seen: dict[int, list[tuple[int, str]]] = {}
    order: list[int] = []
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen[id(p)] = []
                order.append(id(p))
            if all(j != i for j, _ in seen[id(p)]):
                seen[id(p)].append((i, name))
    return [seen[k] for k in order if len(seen[k]) > 1]


@dataclass
class GradientReducer:
    """The ``REDUCE_GRADS`` instruction: sum tied weights across stages, average over data.

    ``tied``: (parameter, group of the stages that hold it) for each tied weight this rank holds
    and shares with another stage. ``data_group`` of size ``data_size`` > 1 averages every
    gradient (one flat bucket, like DDP's, to keep the message count small).
    """

    params: list[nn.Parameter]
    tied: list[tuple[nn.Parameter, dist.ProcessGroup]] = field(default_factory=list)
    data_group: dist.ProcessGroup | None = None
    data_size: int = 1

    def __call__(self) -> None:
        for p in self.params:
            if p.grad is None:  # every rank must contribute, even a parameter unused this step
                p.grad = torch.zeros_like(p)
        for p, group in self.tied:
            dist.all_reduce(p.grad, group=group)
        if self.data_size > 1 and self.params:
            grads = [p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.data_group)
            flat /= self.data_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def global_grad_norm(
    params: Sequence[nn.Parameter],
    pipeline_group: dist.ProcessGroup | None,
    exclude: Sequence[nn.Parameter] = (),
    norm_type: float = 2.0,
) -> Tensor:
    """The norm of the whole model's gradient, from the stages' pieces.

    ``exclude``: copies of tied weights held by a non-owning stage, so each weight counts once.
    Gradients are already equal across data-parallel replicas, so only the pipeline group sums.
    """
    skip = {id(p) for p in exclude}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    device = params[0].device if params else torch.device("cpu")
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
        local = local.to(device, torch.float32)
        if pipeline_group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pipeline_group)
        return local
    local = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        local += g.detach().float().norm(norm_type) ** norm_type
    if pipeline_group is not None:
        dist.all_reduce(local, group=pipeline_group)
    return local ** (1.0 / norm_type)


def clip_grad_norm_global(
    params: Sequence[nn.Parameter],
    max_norm: float,
    pipeline_group: dist.ProcessGroup | None,
    exclude: Sequence[nn.Parameter] = (),
    norm_type: float = 2.0,
) -> Tensor:
    """Scale every stage's gradients by ``min(1, max_norm / global_norm)`` (as
    ``torch.nn.utils.clip_grad_norm_`` does on one process); returns the global norm."""
    total = global_grad_norm(params, pipeline_group, exclude, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
