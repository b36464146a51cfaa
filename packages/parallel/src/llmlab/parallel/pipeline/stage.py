"""One rank's share of a pipeline-splittable model: its chunks and its tied weights.

Every rank computes the same global cut (the layer range of every virtual stage) from the full
``pipeline_layers()`` list, so the collective set-up that follows (tied-weight groups) is done in
the same order everywhere without any exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from llmlab.parallel.pipeline.grads import find_tied_parameters
from llmlab.parallel.pipeline.partition import local_virtual_stages, split_ranges


def pipeline_layers_of(model: nn.Module) -> list[nn.Module]:
    """``model.pipeline_layers()``, or a clear error when the model is not pipeline-splittable."""
    fn = getattr(model, "pipeline_layers", None)
    if not callable(fn):
        raise TypeError(
            f"{type(model).__name__} has no pipeline_layers() method; a pipelined model must "
            "return its ordered list of one-tensor-to-one-tensor layers (DESIGN §3)"
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
) -> StageModules:
    """Cut ``layers`` into ``num_stages × virtual_stages`` parts and take ``stage``'s chunks."""
    ranges = split_ranges(layers, num_stages * virtual_stages, boundaries)
    mine = local_virtual_stages(stage, num_stages, virtual_stages)
    chunks = [nn.Sequential(*(layers[i] for i in ranges[vs])) for vs in mine]
    local = [i for vs in mine for i in ranges[vs]]
    stage_of_layer = {i: vs % num_stages for vs, r in enumerate(ranges) for i in r}
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
