"""A ZeRO engine's parameters and optimizer state as a layout-free sharded checkpoint.

On disk every key is an *unsharded* model's parameter name with its global shape:

    model.<name>               the fp32 master values (the parameter itself at stage 0)
    optim.<name>.<state key>   optimizer state shaped like the parameter (AdamW: exp_avg,
                               exp_avg_sq), or a scalar saved once (AdamW's step)
    meta                       JSON: tied-parameter aliases, the param groups' settings
    extra                      anything small the caller adds (LR scheduler, step, data order)

A rank writes only the boxes its shard covers (:mod:`llmlab.parallel.checkpoint.boxes`), and on
load asks for the boxes of *its* layout, so a checkpoint written at ``dp=2, zero=1`` loads at
``dp=4, zero=3``, at stage 0, or -- consolidated -- into a plain model. ``placement`` maps a
parameter to its offset and global shape when the engine's parameters are themselves slices
(tensor parallelism); by default they are the global tensors.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from llmlab.parallel.checkpoint import files
from llmlab.parallel.checkpoint.boxes import ShardedView
from llmlab.parallel.data.zero import ZeroEngine

FORMAT = 1
_SETTING_TYPES = (int, float, str, bool, tuple, list, Tensor)
Placement = Callable[[str, nn.Parameter], tuple[Sequence[int], Sequence[int]]]


def _view(values: Tensor, p: nn.Parameter, name: str, lo: int, placement: Placement | None):
    offset, global_shape = placement(name, p) if placement is not None else (None, None)
    return ShardedView.from_flat(values.detach().reshape(-1), p.shape, lo, offset, global_shape)


def optimizer_settings(optimizer: Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    out = []
    for group in optimizer.param_groups:
        out.append(
            {
                k: (v.item() if isinstance(v, Tensor) else v)
                for k, v in group.items()
                if k != "params" and (v is None or isinstance(v, _SETTING_TYPES))
            }
        )
    return out


def sharded_state_dict(
    engine: ZeroEngine,
    optimizer: Optimizer | None = None,
    extra: Any = None,
    placement: Placement | None = None,
) -> dict[str, Any]:
    """This rank's part of the checkpoint, as views into live storage (nothing is copied)."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for name, p, lo, hi, values in engine.pieces():
        model[name] = _view(values, p, name, lo, placement)
        state = optimizer.state.get(engine.optimizer_param(p), {}) if optimizer else {}
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, Tensor):
                continue
            if value.numel() == hi - lo and value.dim() > 0:
                entry[key] = _view(value, p, name, lo, placement)
            else:
                entry[key] = value  # a scalar (AdamW's step): equal on every rank, saved once
        if entry:
            optim[name] = entry
    meta = {
        "format": FORMAT,
        "aliases": engine.aliases,
        "param_groups": optimizer_settings(optimizer),
    }
    out: dict[str, Any] = {"model": model, "meta": json.dumps(meta)}
    if optim:
        out["optim"] = optim
    if extra is not None:
        out["extra"] = pickle.dumps(extra)
    return out


def save_zero(
    path: str | os.PathLike,
    engine: ZeroEngine,
    optimizer: Optimizer | None = None,
    extra: Any = None,
    placement: Placement | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write the engine's shards (and the optimizer's) to ``path``; a collective over ``group``
    (every rank that holds a part of the model: the world, by default)."""
    files.save(sharded_state_dict(engine, optimizer, extra, placement), path, group)


def load_zero(
    path: str | os.PathLike,
    engine: ZeroEngine,
    optimizer: Optimizer | None = None,
    placement: Placement | None = None,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Load ``path`` into this rank's shards, whatever layout wrote it; returns ``extra``.

    The optimizer (already rewired) gets fresh state tensors shaped like this rank's pieces,
    filled from disk, and its param groups' settings (learning rate...) are restored.
    """
    md = files.metadata(path).state_dict_metadata
    target: dict[str, Any] = {"model": {}, "meta": None}
    created: list[tuple[Tensor, dict[str, Tensor]]] = []
    for name, p, lo, _, values in engine.pieces():
        if f"model.{name}" not in md:
            raise KeyError(f"{path} has no parameter {name!r} (it holds {_some_keys(md)})")
        target["model"][name] = _view(values, p, name, lo, placement)
        if optimizer is None:
            continue
        view = partial(_view, p=p, name=name, lo=lo, placement=placement)
        state = fresh_optimizer_state(md, name, values, p.dim(), view, target)
        created.append((engine.optimizer_param(p), state))
    if "extra" in md:
        target["extra"] = None
    files.load(target, path, group)
    if optimizer is not None:
        for param, state in created:
            if state:
                optimizer.state[param] = state
        restore_optimizer_settings(optimizer, json.loads(target["meta"])["param_groups"])
    engine.refresh_params()
    return pickle.loads(target["extra"]) if target.get("extra") is not None else None


def fresh_optimizer_state(
    md: Mapping[str, Any],
    name: str,
    like: Tensor,
    ndim: int,
    view: Callable[[Tensor], Any],
    target: dict[str, Any],
) -> dict[str, Tensor]:
    """Optimizer state for parameter ``name`` as the checkpoint's index lists it, zero-filled for
    DCP to load into: element-wise entries (``ndim`` dims, like the parameter) shaped like
    ``like`` (this rank's piece) and entered into ``target`` as ``view(entry)``; scalars (AdamW's
    step) whole."""
    state: dict[str, Tensor] = {}
    prefix = f"optim.{name}."
    for key, entry in md.items():
        if not key.startswith(prefix) or not isinstance(entry, TensorStorageMetadata):
            continue
        skey = key[len(prefix) :]
        if len(entry.size) == ndim and entry.size != torch.Size([]):
            state[skey] = torch.zeros_like(like, dtype=entry.properties.dtype)
            value = view(state[skey])
        else:
            state[skey] = torch.zeros(entry.size, dtype=entry.properties.dtype)
            value = state[skey]
        target.setdefault("optim", {}).setdefault(name, {})[skey] = value
    return state


def restore_optimizer_settings(optimizer: Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} param groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    for group, settings in zip(optimizer.param_groups, saved):
        for key, value in settings.items():
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            if isinstance(group.get(key), Tensor):
                group[key].fill_(value)
            else:
                group[key] = value


def _some_keys(md: dict[str, Any]) -> str:
    keys = sorted(k[len("model.") :] for k in md if k.startswith("model."))
    return f"{keys[:4]}{' ...' if len(keys) > 4 else ''}"


def read_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` a checkpoint was saved with (``None`` if none), on one process, no group:
    for an N-D Trainer checkpoint, Lightning's own state (hyper-parameters, loops...)."""
    try:
        return pickle.loads(files.read_object(path, "extra"))
    except KeyError:
        return None


def consolidate(path: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Tensor]:
    """One plain ``state_dict`` (tied aliases included) from a sharded checkpoint, on one
    process; saved with ``torch.save`` to ``out`` when given, atomically."""
    state = files.read_full(path, "model.")
    meta = json.loads(files.read_object(path, "meta"))
    for alias, canonical in meta.get("aliases", {}).items():
        state[alias] = state[canonical]
    if out is not None:
        out = os.fspath(out)
        tmp = f"{out}.partial"
        torch.save(state, tmp)
        os.replace(tmp, out)
    return state
