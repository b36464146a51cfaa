"""Gradient bookkeeping across stages: tied weights and data parallelism.

Tied weights: GPT ties its input embedding to its LM head. When those layers land on different
stages, each stage holds a copy of the one weight and computes half of its gradient, so the two
halves are summed across the stages that hold it (Megatron-LM's embedding group) -- then both
copies take the same optimizer step and stay equal, and the gradient equals single-process.

Data parallelism: each data-parallel replica of a stage saw its share of the global batch, and
the loss is a mean, so its gradients are averaged within the stage's data-parallel group.
Expert slices (expert parallelism) are summed over the ranks that hold the same experts and
divided by the same data-group size (:mod:`llmlab.parallel.expert` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from llmlab.parallel.buffers import all_reduce_mean_


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
    gradient (one flat buffer, like DDP's bucket, to keep the message count small).
    ``tied_bytes`` / ``data_bytes`` count what was reduced since the last ``reset_counts``.
    """

    params: list[nn.Parameter]
    tied: list[tuple[nn.Parameter, dist.ProcessGroup]] = field(default_factory=list)
    data_group: dist.ProcessGroup | None = None
    data_size: int = 1
    tied_bytes: int = 0
    data_bytes: int = 0
    experts: list[nn.Parameter] = field(default_factory=list)  # expert slices (expert > 1)
    expert_group: dist.ProcessGroup | None = None  # the ranks holding the same experts
    replicas: int = 1  # data × context: what expert gradients are divided by

    def __call__(self) -> None:
        for p in self.params:
            if p.grad is None:  # every rank must contribute, even a parameter unused this step
                p.grad = torch.zeros_like(p)
        for p, group in self.tied:
            dist.all_reduce(p.grad, group=group)
            self.tied_bytes += p.grad.numel() * p.grad.element_size()
        if self.data_size > 1:
            experts = {id(p) for p in self.experts}
            grads = [p.grad for p in self.params if id(p) not in experts]
            self.data_bytes += all_reduce_mean_(grads, self.data_group, self.data_size)
        self.reduce_experts()

    def reduce_experts(self) -> None:
        """Expert slices: summed over the ranks holding the same experts, divided by the
        ``replicas`` whose losses each count for an average (:mod:`llmlab.parallel.expert`).
        Also called on its own under ZeRO, which reduces every other gradient itself."""
        if not self.experts or self.replicas == 1:
            return
        for p in self.experts:
            if p.grad is None:  # every rank must contribute, even with no row routed here
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.experts]
        if dist.get_world_size(self.expert_group) > 1:
            self.data_bytes += all_reduce_mean_(grads, self.expert_group, self.replicas)
        else:  # one copy of these experts: nothing to sum, the same division
            torch._foreach_div_(grads, float(self.replicas))

    def reset_counts(self) -> None:
        self.tied_bytes = self.data_bytes = 0
