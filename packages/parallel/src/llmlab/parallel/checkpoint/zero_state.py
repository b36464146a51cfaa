"""A :class:`~llmlab.parallel.data.zero.ZeroEngine`'s state in checkpoints: what the engine
holds is pieces of flat shards, what a checkpoint holds is tensors by name.

* sharded, for an engine on its own (a plain data-parallel loop, no Trainer): :func:`save_zero`
  / :func:`load_zero`, a :class:`~llmlab.parallel.checkpoint.layout_state.LayoutState` with the
  engine's data group as the only dimension. A rank writes only the boxes its shard covers, and
  on load asks for the boxes of *its* layout, so a checkpoint written at ``dp=2, zero=1`` loads
  at ``dp=4, zero=3``, at stage 0, into the N-D strategy, or -- consolidated -- into a plain
  model;
* full tensors by name (a collective over the engine's group), for consolidated checkpoints
  and inspection: :func:`zero_full_params`, :func:`zero_full_optimizer_state`, and their
  inverses, which give each rank its pieces.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from llmlab.parallel.checkpoint.layout_state import LayoutState, read_extra
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.data.zero_layout import all_gather_into
from llmlab.parallel.mesh import Coords


def _layout_state(engine: ZeroEngine) -> LayoutState:
    return LayoutState(
        engine.module,
        coords=Coords(engine.rank, 0, 0, 0),
        tensor_size=1,
        data_size=engine.world,
        zero=engine,
        group=engine.group,
    )


def save_zero(
    path: str | os.PathLike,
    engine: ZeroEngine,
    optimizer: Optimizer | None = None,
    extra: Any = None,
) -> None:
    """Write the engine's shards (and the optimizer's) to ``path``; a collective over the
    engine's group."""
    _layout_state(engine).save(path, [optimizer] if optimizer is not None else [], extra)


def load_zero(
    path: str | os.PathLike, engine: ZeroEngine, optimizer: Optimizer | None = None
) -> Any:
    """Load ``path`` into this rank's shards, whatever layout wrote it; returns ``extra``.

    The optimizer (already rewired) gets fresh state tensors shaped like this rank's pieces,
    filled from disk, and its param groups' settings (learning rate...) are restored.
    """
    _layout_state(engine).load(path, [optimizer] if optimizer is not None else [])
    engine.refresh_params()
    return read_extra(path)


# ------------------------------------------------------------------ full tensors by name
@torch.no_grad()
def zero_full_params(engine: ZeroEngine) -> dict[str, Tensor]:
    """Every parameter the engine manages, in full (master precision) and by name, assembled
    from the data shards: a collective over the engine's group."""
    if engine.stage == 0:
        return {n: p.detach().clone() for n, p in engine.named_params()}
    return _gather_by_name(engine, {id(pc.param): pc.master for pc in engine.all_pieces()})


@torch.no_grad()
def load_zero_full_params(engine: ZeroEngine, values: Mapping[str, Tensor]) -> None:
    """Set the parameters from full (local-shape) tensors by name: each rank copies its pieces
    into its master shard, then the compute parameters follow."""
    missing = [n for n, _ in engine.named_params() if n not in values]
    if missing:
        raise KeyError(f"no value for {len(missing)} parameters, e.g. {missing[:4]}")
    if engine.stage == 0:
        for name, p in engine.named_params():
            p.copy_(values[name])
        return
    for pc in engine.all_pieces():
        pc.master.copy_(values[pc.name].reshape(-1)[pc.lo : pc.hi])
    engine.refresh_params()


def zero_full_optimizer_state(
    engine: ZeroEngine, optimizer: Optimizer
) -> dict[str, dict[str, Any]]:
    """``optimizer``'s state by parameter name at the parameters' (local) full shapes: the
    pieces' element-wise state all-gathered over the group, scalars (AdamW's ``step``) taken
    from this rank's pieces (they are equal everywhere). A collective."""
    if engine.stage == 0:
        raise ValueError("at ZeRO stage 0 the optimizer holds the full parameters already")
    keys: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pc in engine.all_pieces():
        for key, value in optimizer.state.get(pc.master, {}).items():
            if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == pc.hi - pc.lo:
                keys.setdefault(key, value)
            else:
                scalars.setdefault(pc.name, {})[key] = value
    # every rank must run the same gathers: agree on the element-wise keys
    names: list[Any] = [None] * engine.world
    dist.all_gather_object(names, sorted(keys), group=engine.group)
    parts: list[Any] = [None] * engine.world
    dist.all_gather_object(parts, scalars, group=engine.group)
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, entry in part.items():
            out.setdefault(name, {}).update(entry)
    for key in sorted({k for part in names for k in part}):
        values = {
            id(pc.param): optimizer.state[pc.master][key]
            for pc in engine.all_pieces()
            if key in optimizer.state.get(pc.master, {})
        }
        dtype = keys[key].dtype if key in keys else engine.units[0].master.dtype
        for name, tensor in _gather_by_name(engine, values, dtype).items():
            out.setdefault(name, {})[key] = tensor
    return out


@torch.no_grad()
def load_zero_full_optimizer_state(
    engine: ZeroEngine, optimizer: Optimizer, state: Mapping[str, Mapping[str, Any]]
) -> None:
    """The inverse of :func:`zero_full_optimizer_state`: each piece gets its elements."""
    for pc in engine.all_pieces():
        saved = state.get(pc.name)
        if saved is None:
            continue
        entry: dict[str, Any] = {}
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                entry[key] = value.reshape(-1)[pc.lo : pc.hi].to(pc.master.device).clone()
            else:
                entry[key] = value.clone() if isinstance(value, Tensor) else value
        optimizer.state[pc.master] = entry
    engine.memory.measure_optimizer()


def _gather_by_name(
    engine: ZeroEngine, values: Mapping[int, Tensor], dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """``values[id(param)]`` is this rank's 1-D piece of a parameter; all-gather each unit
    over the group and return every parameter at its (local) full shape, by name."""
    out: dict[str, Tensor] = {}
    for u in engine.units:
        shard = torch.zeros(u.shard_numel, dtype=dtype or u.master.dtype, device=u.master.device)
        for pc in u.pieces:
            v = values.get(id(pc.param))
            if v is not None:
                shard[pc.at : pc.at + pc.hi - pc.lo].copy_(v.reshape(-1))
        flat = shard.new_empty(u.full.data.numel())
        all_gather_into(flat, shard, group=engine.group)
        for name, offset, p in zip(u.names, u.full.offsets, u.params, strict=True):
            out[name] = flat[offset : offset + p.numel()].view(p.shape).clone()
    return out
