"""Consolidated checkpoints for any data × pipeline × tensor layout: one file of full tensors.

A checkpoint written by any layout holds the *unsplit* model: every tensor under the plain
model's state-dict key, at its full shape. So it loads into a plain ``GPT`` for decoding and into
any other layout to resume (docs/architecture.md#where-state-lives). Two primitives do all of it:

* :func:`gather_full` -- this rank's tensors (``name -> (tensor, tensor-parallel shard dim)``)
  all-gathered along their shard dimension over the tensor group (an expert slice, whose dim is
  an :class:`ExpertDim`, over the expert group), then merged over the pipeline
  group (each stage contributes the layers it holds; storage-less ``meta`` placeholders of other
  stages' layers are skipped). Data-parallel replicas hold equal values and are not consulted.
* :func:`local_slices` -- the inverse: from full tensors, this rank's shard of each tensor it
  holds.

Model weights (:func:`full_state_dict` for a tensor-parallel module on its own), optimizer state
(keyed by parameter *name*, not by position, because positions differ between layouts) and fp32
master weights all go through these two functions; ZeRO's pieces are first assembled over the
data group (:mod:`llmlab.parallel.checkpoint.zero_state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.expert import EXPERT_ATTR
from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR

FORMAT = "llmlab.consolidated/2"
Named = Mapping[str, tuple[Tensor, int | None]]  # name -> (tensor, tensor-parallel shard dim)


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class ExpertDim(int):
    """The split dimension of an expert slice (0: the stacked experts), told apart from a
    tensor-parallel shard's because it is split over the expert group. Expert slices are
    replicated over the tensor group, so no tensor is split both ways."""


def shard_dim(t: Tensor) -> int | None:
    """The dimension ``t`` is split along: a tensor-parallel shard's, an :class:`ExpertDim`
    for an expert slice (expert parallelism), ``None`` for a whole tensor."""
    dim = getattr(t, SHARD_DIM_ATTR, None)
    return ExpertDim(0) if dim is None and hasattr(t, EXPERT_ATTR) else dim


def split_group(
    dim: int | None, tensor_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The group a tensor split along ``dim`` is split over."""
    return expert_group if isinstance(dim, ExpertDim) else tensor_group


def named_state(module: nn.Module) -> dict[str, tuple[Tensor, int | None]]:
    """The module's state-dict entries (clean keys: wrapper prefixes removed by the wrappers' own
    hooks), each with its tensor-parallel shard dimension."""
    return {k: (t, shard_dim(t)) for k, t in module.state_dict(keep_vars=True).items()}


def _gather_along(t: Tensor, dim: int | None, group: dist.ProcessGroup | None) -> Tensor:
    t = t.detach()
    if dim is None or _size(group) == 1:
        return t.clone()
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def gather_full(
    named: Named,
    tensor_group: dist.ProcessGroup | None,
    pipeline_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """Full tensors (on the CPU) of every name held anywhere in the pipeline; a collective over
    the groups (every rank of a stage calls it with the same names in the same order)."""
    local = {
        name: _gather_along(t, dim, split_group(dim, tensor_group, expert_group)).cpu()
        for name, (t, dim) in named.items()
        if not t.is_meta
    }
    if _size(pipeline_group) == 1:
        return local
    parts: list[Any] = [None] * _size(pipeline_group)
    dist.all_gather_object(parts, local, group=pipeline_group)
    merged: dict[str, Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def local_slices(
    full: Mapping[str, Any],
    named: Named,
    tensor_group: dist.ProcessGroup | None,
    strict: bool = True,
    expert_group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """This rank's slice of each full tensor it holds (``meta`` placeholders are skipped)."""
    held = {name: (t, dim) for name, (t, dim) in named.items() if not t.is_meta}
    missing = [name for name in held if name not in full]
    if strict and missing:
        raise KeyError(
            f"the checkpoint lacks {len(missing)} tensors this rank holds: {missing[:5]}"
        )
    out = {}
    for name, (t, dim) in held.items():
        if name not in full:
            continue
        value = full[name]
        group = split_group(dim, tensor_group, expert_group)
        n = _size(group)
        if dim is not None and n > 1:
            if value.shape[dim] % n:
                what = "expert-parallel" if isinstance(dim, ExpertDim) else "tensor-parallel"
                raise ValueError(
                    f"{name}: size {value.shape[dim]} along dim {dim} is not divisible by the "
                    f"{what} size {n}"
                )
            value = value.chunk(n, dim=dim)[dist.get_rank(group)]
        if value.shape != t.shape:
            raise ValueError(
                f"{name}: checkpoint slice of shape {tuple(value.shape)} does not fit this "
                f"rank's tensor of shape {tuple(t.shape)}"
            )
        out[name] = value
    return out


def load_local_(named: Named, slices: Mapping[str, Tensor]) -> None:
    """Copy ``slices`` into the live tensors of ``named`` (in place, tied tensors stay tied)."""
    with torch.no_grad():
        for name, value in slices.items():
            named[name][0].copy_(value)


def full_state_dict(
    module: nn.Module,
    tensor_group: dist.ProcessGroup | None = None,
    pipeline_group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """The unsplit ``state_dict`` of a split ``module`` (on the CPU): a collective."""
    return gather_full(named_state(module), tensor_group, pipeline_group)


def load_full_state_dict(
    module: nn.Module,
    full: Mapping[str, Tensor],
    tensor_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Load an unsplit state dict into a split ``module``: each rank copies its slices."""
    named = named_state(module)
    load_local_(named, local_slices(full, named, tensor_group, strict=strict))


# ---------------------------------------------------------------------------- optimizer
def _flat_params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_plain_optimizer_state(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    tensor_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> Mapping[str, Any]:
    """A one-process optimizer state (``torch``'s own: by position) for this rank's optimizer,
    which steps the same parameters in the same order, some of them tensor-parallel shards or
    expert slices: each full-shape state tensor of a split parameter sliced to this rank's
    part. Unchanged without split parameters; with them, a different parameter count (a
    pipeline stage holds fewer) is refused (torch would pair the states with the wrong
    parameters)."""
    params = _flat_params(optimizer)
    positions = [i for group in saved.get("param_groups", []) for i in group["params"]]
    splits = [split_group(shard_dim(p), tensor_group, expert_group) for p in params]
    if not any(shard_dim(p) is not None and _size(g) > 1 for p, g in zip(params, splits)):
        return saved
    if len(positions) != len(params):
        raise ValueError(
            f"a one-process optimizer state of {len(positions)} parameters cannot resume an "
            f"optimizer of {len(params)} (a pipeline stage's): resume from this layout's own "
            "checkpoint, or one written by the N-D strategy (by parameter name)"
        )
    state = {}
    for pos, p, group in zip(positions, params, splits, strict=True):
        dim, n = shard_dim(p), _size(group)
        rank = dist.get_rank(group) if n > 1 else 0
        state[pos] = {
            key: value.chunk(n, dim=dim)[rank].clone()
            if dim is not None and isinstance(value, Tensor) and value.shape != p.shape
            and value.dim() == p.dim()
            else value
            for key, value in saved["state"].get(pos, {}).items()
        }  # fmt: skip
        if not state[pos]:
            del state[pos]
    return {**saved, "state": state}


def optimizer_state(
    optimizer: Optimizer,
    info: Mapping[int, tuple[str, int | None]],
    tensor_group: dist.ProcessGroup | None,
    pipeline_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name and at full shape (a collective).

    ``info``: ``id(optimizer parameter) -> (name, shard dim)`` (for fp32 master weights, the
    name and dim of the model parameter they stand for).
    """
    packed = optimizer.state_dict()
    params = _flat_params(optimizer)
    names = [info[id(p)][0] for p in params]
    tensors, scalars = split_state(
        ((params[idx], entry) for idx, entry in packed["state"].items()), info
    )
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in packed["param_groups"]
    ]
    return named_optimizer_state(
        tensors, scalars, groups, tensor_group, pipeline_group, expert_group
    )


def split_state(
    entries: Iterable[tuple[Tensor, Mapping[str, Any]]],
    info: Mapping[int, tuple[str, int | None]],
) -> tuple[dict[str, tuple[Tensor, int | None]], dict[str, dict[str, Any]]]:
    """Per-parameter optimizer state split into what is gathered (tensors of the parameter's
    shape: ``"name\0key" -> (tensor, shard dim)``) and what is kept as is (steps, scalars)."""
    tensors: dict[str, tuple[Tensor, int | None]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, entry in entries:
        name, dim = info[id(p)]
        scalars[name] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.shape == p.shape:
                tensors[f"{name}\0{key}"] = (value, dim)
            else:
                scalars[name][key] = value.detach().cpu() if isinstance(value, Tensor) else value
    return tensors, scalars


def named_optimizer_state(
    tensors: Named,
    scalars: dict[str, dict[str, Any]],
    groups: list[dict[str, Any]],
    tensor_group: dist.ProcessGroup | None,
    pipeline_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The consolidated optimizer state from this rank's pieces, already keyed by name:
    ``tensors`` (``"name\0key" -> (tensor, shard dim)``), ``scalars`` (name -> key -> value) and
    the param ``groups`` with parameter names (a collective over both groups)."""
    full = gather_full(tensors, tensor_group, pipeline_group, expert_group)
    if _size(pipeline_group) > 1:
        parts: list[Any] = [None] * _size(pipeline_group)
        dist.all_gather_object(parts, (scalars, groups), group=pipeline_group)
        scalars, merged_groups = {}, [dict(g, params=[]) for g in groups]
        for part_scalars, part_groups in parts:
            scalars.update(part_scalars)
            for g, pg in zip(merged_groups, part_groups, strict=True):
                g["params"] += [n for n in pg["params"] if n not in g["params"]]
        groups = merged_groups
    state: dict[str, dict[str, Any]] = {name: dict(entry) for name, entry in scalars.items()}
    for key, value in full.items():
        name, field = key.split("\0")
        state.setdefault(name, {})[field] = value
    return {"format": FORMAT, "state": state, "param_groups": groups}


def load_optimizer_state(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    info: Mapping[int, tuple[str, int | None]],
    tensor_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> None:
    """Load a name-keyed full optimizer state into this rank's (sharded, partial) optimizer."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved['param_groups'])} optimizer parameter groups, this "
            f"optimizer {len(optimizer.param_groups)}"
        )
    params = _flat_params(optimizer)
    tensors = {}
    for p in params:
        name, dim = info[id(p)]
        for key, value in saved["state"].get(name, {}).items():
            if isinstance(value, Tensor) and value.dim() == p.dim() and value.dim() > 0:
                tensors[f"{name}\0{key}"] = (p, dim)  # a stand-in of the right shard shape
    full = {
        f"{name}\0{key}": value
        for name, entry in saved["state"].items()
        for key, value in entry.items()
        if isinstance(value, Tensor)
    }
    slices = local_slices(full, tensors, tensor_group, strict=True, expert_group=expert_group)
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        name, _ = info[id(p)]
        if name not in saved["state"]:
            continue
        state[i] = {
            key: slices.get(f"{name}\0{key}", value) for key, value in saved["state"][name].items()
        }
    groups = [
        {**{k: v for k, v in sg.items() if k != "params"}, "params": list(range(start, start + n))}
        for sg, start, n in _ranges(optimizer, saved)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _ranges(optimizer: Optimizer, saved: Mapping[str, Any]) -> Iterable[tuple[dict, int, int]]:
    start = 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        yield saved_group, start, len(group["params"])
        start += len(group["params"])
