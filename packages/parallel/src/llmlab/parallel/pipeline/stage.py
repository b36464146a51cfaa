"""One rank's share of a pipeline-splittable model: its chunks and its tied weights.

Every rank computes the same global cut (the layer range of every virtual stage) from the full
``pipeline_layers()`` list, so the collective set-up that follows (tied-weight groups) is done in
the same order everywhere without any exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.pipeline.grad_sync import find_tied_parameters
from llmlab.parallel.pipeline.partition import chunk_owner, local_virtual_stages, split_ranges


def pipeline_layers_of(model: nn.Module) -> list[nn.Module]:
    """``model.pipeline_layers()``, or a clear error when the model is not pipeline-splittable."""
    fn = getattr(model, "pipeline_layers", None)
    if not callable(fn):
        raise TypeError(
            f"{type(model).__name__} has no pipeline_layers() method; a pipelined model must "
            "return its ordered list of one-tensor-to-one-tensor layers "
            "(docs/architecture.md#contracts)"
        )
    layers = list(fn())
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError(f"{type(model).__name__}.pipeline_layers() must return nn.Modules")
    return layers


@dataclass
class StageModules:
    """The chunks of one stage and what it needs to know about the rest of the pipeline."""

    chunks: list[nn.Sequential]
    ranges: list[range]  # layer indices of every virtual stage (global)
    local_layers: list[int]  # indices of this stage's layers
    tie_stages: list[list[int]]  # for each tied weight: the stages that hold a copy
    tied_local: list[tuple[nn.Parameter, int]] = field(default_factory=list)  # (param, tie index)
    duplicate_copies: list[nn.Parameter] = field(default_factory=list)  # not the owner's copy


def cut_stage(
    layers: Sequence[nn.Module],
    num_stages: int,
    stage: int,
    virtual_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    placement: str = "loop",
) -> StageModules:
    """Cut ``layers`` into ``num_stages × virtual_stages`` parts and take ``stage``'s chunks;
    ``placement`` says which parts a rank holds ("loop", or "v" for ZB-V and DualPipeV:
    :func:`~llmlab.parallel.pipeline.partition.chunk_owner`)."""
    ranges = split_ranges(layers, num_stages * virtual_stages, boundaries)
    mine = local_virtual_stages(stage, num_stages, virtual_stages, placement)
    chunks = [nn.Sequential(*(layers[i] for i in ranges[vs])) for vs in mine]
    local = [i for vs in mine for i in ranges[vs]]
    stage_of_layer = {
        i: chunk_owner(vs, num_stages, placement)[0] for vs, r in enumerate(ranges) for i in r
    }
    tie_stages: list[list[int]] = []
    tied_local: list[tuple[nn.Parameter, int]] = []
    duplicates: list[nn.Parameter] = []
    for t, group in enumerate(find_tied_parameters(layers)):
        stages = sorted({stage_of_layer[i] for i, _ in group})
        tie_stages.append(stages)
        if stage in stages and len(stages) > 1:
            layer_idx, name = next((i, n) for i, n in group if stage_of_layer[i] == stage)
            param = layers[layer_idx].get_parameter(name)
            tied_local.append((param, t))
            if stage != stages[0]:
                duplicates.append(param)
    return StageModules(chunks, ranges, local, tie_stages, tied_local, duplicates)


def build_tie_groups(
    modules: StageModules, pipelines: Sequence[Sequence[int]]
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """Process groups joining the copies of each tied weight, one per pipeline replica.

    ``pipelines``: the global ranks of every pipeline (one list per data-parallel replica, ranks
    by stage). ``new_group`` is collective, so every rank creates every group in the same order.
    """
    me = dist.get_rank()
    groups: dict[int, dist.ProcessGroup] = {}
    for t, stages in enumerate(modules.tie_stages):
        if len(stages) < 2:
            continue
        for pipeline in pipelines:
            ranks = [pipeline[s] for s in stages]
            group = dist.new_group(ranks)
            if me in ranks:
                groups[t] = group
    return [(param, groups[t]) for param, t in modules.tied_local]


def prune_to_stage(model: nn.Module, keep: Sequence[nn.Module]) -> int:
    """Replace every parameter and buffer of ``model`` that no module in ``keep`` uses by a
    storage-less ``meta`` tensor of the same shape; returns the parameters actually held.

    The module tree, names and shapes stay those of the unsplit model, so code that only reads
    metadata (``numel()`` for a FLOP count, the task's grouping of parameters by module type)
    still works; the memory goes. A tied weight used by a kept layer survives under every name
    it has, and a dropped tied weight stays tied (one placeholder per original tensor).
    """
    keep_params = {id(p) for m in keep for p in m.parameters()}
    keep_buffers = {id(b) for m in keep for b in m.buffers()}
    placeholders: dict[int, Tensor] = {}

    def placeholder(t: Tensor, param: bool) -> Tensor:
        if id(t) not in placeholders:
            empty = torch.empty_like(t, device="meta")
            placeholders[id(t)] = nn.Parameter(empty, t.requires_grad) if param else empty
        return placeholders[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in keep_params:
                module._parameters[name] = placeholder(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) not in keep_buffers:
                module._buffers[name] = placeholder(b, False)
    return held_parameter_count(model)


def held_parameter_count(model: nn.Module) -> int:
    """Parameters with storage on this rank (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if not p.is_meta)


def move_held_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors this rank holds, leaving ``meta`` placeholders
    (which cannot be copied) alone and keeping tied parameters tied."""
    moved: dict[int, Tensor] = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None or t.is_meta or t.device == device:
                    continue
                if id(t) not in moved:
                    data = t.data.to(device)
                    moved[id(t)] = (
                        nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                    )
                store[name] = moved[id(t)]
