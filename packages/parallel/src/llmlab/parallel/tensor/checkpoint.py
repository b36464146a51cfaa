"""Consolidated checkpoints: sharded parameters (and their optimizer state) are gathered on save
and sliced on load, so a checkpoint from any tensor-parallel degree loads into a plain model or
into any other degree (docs/architecture.md#where-state-lives).

A sharded parameter carries ``tp_shard_dim`` (set by ``shard_parameter``); that is all that is
needed, so the plan is not consulted here. Collectives here are not recorded in the ledger: they
are not part of a training step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR
from llmlab.parallel.tensor.primitives import Group


def _gather(t: Tensor, dim: int, group: Group) -> Tensor:
    n = C.group_size(group)
    if n == 1:
        return t.detach().clone()
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _slice(full: Tensor, dim: int, group: Group, what: str) -> Tensor:
    n = C.group_size(group)
    C.check_divisible(full.shape[dim], n, what)
    return full.chunk(n, dim=dim)[C.group_rank(group)]


def _tensors_by_state_key(module: nn.Module) -> dict[str, Tensor]:
    """State-dict key -> the live parameter/buffer (tied parameters appear under every name)."""
    named: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(dict(module.named_buffers(remove_duplicate=False)))
    return named


def consolidated_state_dict(module: nn.Module, group: Group) -> dict[str, Tensor]:
    """The full (unsharded) state dict of ``module``; a collective: call on every TP rank."""
    live = _tensors_by_state_key(module)
    out: dict[str, Tensor] = {}
    for key, value in module.state_dict().items():
        dim = getattr(live.get(key), SHARD_DIM_ATTR, None)
        out[key] = value.detach().clone() if dim is None else _gather(value, dim, group)
    return out


def shard_state_dict(module: nn.Module, full: dict[str, Any], group: Group) -> dict[str, Any]:
    """Slice a consolidated state dict to this rank's shards of ``module``."""
    live = _tensors_by_state_key(module)
    out: dict[str, Any] = {}
    for key, value in full.items():
        dim = getattr(live.get(key), SHARD_DIM_ATTR, None)
        out[key] = value if dim is None else _slice(value, dim, group, key).clone()
    return out


def load_consolidated_state_dict(
    module: nn.Module, full: dict[str, Any], group: Group, strict: bool = True
) -> Any:
    """Load a consolidated (full) state dict into a tensor-parallel ``module``."""
    return module.load_state_dict(shard_state_dict(module, full, group), strict=strict)


def _optimizer_params(
    optimizer: torch.optim.Optimizer, packed: dict[str, Any]
) -> dict[int, nn.Parameter]:
    """The state dict's integer parameter ids -> the live parameters (same order as the groups)."""
    mapping: dict[int, nn.Parameter] = {}
    for group, packed_group in zip(optimizer.param_groups, packed["param_groups"]):
        mapping.update(zip(packed_group["params"], group["params"]))
    return mapping


def consolidated_optimizer_state(optimizer: torch.optim.Optimizer, group: Group) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every per-parameter tensor of a sharded parameter gathered
    (e.g. AdamW's ``exp_avg``/``exp_avg_sq``); a collective."""
    packed = optimizer.state_dict()
    params = _optimizer_params(optimizer, packed)
    state: dict[int, dict[str, Any]] = {}
    for idx in sorted(packed["state"]):
        param = params[idx]
        dim = getattr(param, SHARD_DIM_ATTR, None)
        entry = {}
        for k, v in packed["state"][idx].items():
            sharded = dim is not None and isinstance(v, Tensor) and v.shape == param.shape
            entry[k] = _gather(v, dim, group) if sharded else v
        state[idx] = entry
    return {"state": state, "param_groups": packed["param_groups"]}


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, full: dict[str, Any], group: Group
) -> dict[str, Any]:
    """Slice a consolidated optimizer state dict to this rank's shards (for ``load_state_dict``)."""
    params = _optimizer_params(optimizer, full)
    state: dict[int, dict[str, Any]] = {}
    for idx, entry in full["state"].items():
        param = params[int(idx)]
        dim = getattr(param, SHARD_DIM_ATTR, None)
        full_size = getattr(param, "tp_full_size", None)
        out = {}
        for k, v in entry.items():
            sharded = (
                dim is not None
                and isinstance(v, Tensor)
                and v.dim() == param.dim()
                and v.shape[dim] == full_size
            )
            out[k] = _slice(v, dim, group, f"optimizer state {k}").clone() if sharded else v
        state[int(idx)] = out
    return {"state": state, "param_groups": full["param_groups"]}
