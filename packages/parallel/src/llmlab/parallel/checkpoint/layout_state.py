"""An N-D layout's training state as a sharded checkpoint: each rank writes only what it holds.

The one implementation of the sharded format: the N-D strategy's Trainer checkpoints and
``save_zero`` / ``load_zero`` (a ZeRO engine on its own) both go through :class:`LayoutState`, and
:func:`consolidate` (``python -m llmlab.parallel.checkpoint consolidate``) reads either on one
process. Every key names the *unsplit* model's tensor at its global shape:

    model.<name>               the model's tensors: fp32 masters where a precision plugin or
                               ZeRO keeps them, else the parameters themselves; buffers
    optim.<name>.<state key>   element-wise optimizer state (AdamW: exp_avg, exp_avg_sq) in the
                               same boxes as the parameter, scalars (AdamW's step) whole
    meta                       JSON: tied-parameter aliases, optimizer settings, the layout
    extra                      the caller's small state (Lightning's loops, callbacks, schedulers)

What a rank holds of a tensor is a rectangle of the global tensor (its tensor-parallel slice: the
``chunk(tensor, dim)[rank]`` that :mod:`.consolidated` gathers; an expert-parallel rank's
experts: ``chunk(stack, 0)[index]``, replicated over the tensor ranks and over the expert
groups) or, under ZeRO, a flat range of
that slice (:func:`~llmlab.parallel.checkpoint.boxes.flat_boxes` turns it into
boxes). Exactly one rank writes each element. A tensor several ranks hold equal (data replicas
without ZeRO, what tensor parallelism replicates) goes to one of them, spread by bytes so that
every replica writes about as much (:class:`_Spread`); ZeRO pieces are written by their data
rank; a tied weight by the stage that owns it, not the stage holding its copy. Loading asks for
the boxes of *this* layout, so a checkpoint from one data × pipeline × tensor degree and ZeRO
stage loads into any other.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from llmlab.parallel.checkpoint import files
from llmlab.parallel.checkpoint.boxes import ShardedView
from llmlab.parallel.data.fsdp2 import FSDP2Engine, as_dtensor_like
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.expert import EXPERT_ATTR
from llmlab.parallel.mesh import Coords
from llmlab.parallel.norm import local_tensor
from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR

FORMAT = 1
_SETTING_TYPES = (int, float, str, bool, tuple, list, Tensor)


@dataclass
class Held:
    """One tensor of the unsplit model as this rank holds it."""

    name: str  # the unsplit model's state-dict key ("blocks.0.attn.qkv.weight")
    values: Tensor  # the storage checkpointed: the local tensor, or under ZeRO its elements lo:
    local_shape: tuple[int, ...]  # this rank's (tensor-parallel) slice
    lo: int
    offset: tuple[int, ...]  # where the slice sits in the global tensor
    global_shape: tuple[int, ...]
    writer: bool  # this rank writes these elements (exactly one rank does)
    optimizer_param: Tensor | None  # what the optimizer steps for it here

    def view(self, flat_like_values: Tensor) -> ShardedView:
        """``flat_like_values`` (shaped like ``values``) as boxes of the global tensor."""
        flat = flat_like_values.reshape(-1)
        return ShardedView.from_flat(
            flat, self.local_shape, self.lo, self.offset, self.global_shape
        )


def _placement(
    t: Tensor, tensor_rank: int, tensor_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offset and global shape of a tensor-parallel slice (``chunk(dim)[rank]``)."""
    dim = getattr(t, SHARD_DIM_ATTR, None)
    shape = tuple(t.shape)
    if dim is None or tensor_size == 1:
        return (0,) * len(shape), shape
    offset = [0] * len(shape)
    offset[dim] = tensor_rank * shape[dim]
    global_shape = list(shape)
    global_shape[dim] *= tensor_size
    return tuple(offset), tuple(global_shape)


def _expert_placement(
    t: Tensor, index: int, count: int, replica: int
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Offset and global shape of an expert-parallel rank's experts (``chunk(0)[index]`` of
    ``count``), and which copy of them replica ``replica`` holds: the replicas
    ``index, index + count, ...`` hold the same experts (``ParallelDims.expert_copy_ranks``)."""
    shape = tuple(t.shape)
    offset = (index * shape[0], *[0] * (len(shape) - 1))
    return offset, (shape[0] * count, *shape[1:]), replica // count


class LayoutState:
    """This rank's part of an N-D layout's model and optimizer state, for DCP.

    Args:
        model: the (split) model: its state-dict keys are the unsplit model's.
        coords: this rank's :class:`~llmlab.parallel.mesh.Coords`.
        tensor_size, data_size: the tensor-parallel and data-parallel degrees.
        duplicates: tied copies another stage owns (held here, written there).
        zero: the ZeRO engine, whose fp32 pieces stand for the parameters it manages.
        masters: ``id(model parameter) -> fp32 master`` of a precision plugin (no ZeRO).
        layout: recorded in the checkpoint's meta, for people reading it.
        group: every rank that holds a part of the model (default: the world).
        names: the model's state-dict names written and read (default: every one); a LoRA run
            on a folder's model keeps its adapters alone (what its module's state holds).
    """

    def __init__(
        self,
        model: nn.Module,
        coords: Coords,
        tensor_size: int,
        data_size: int = 1,
        duplicates: Iterable[Tensor] = (),
        zero: ZeroEngine | FSDP2Engine | None = None,
        masters: Mapping[int, Tensor] | None = None,
        layout: Mapping[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
        names: Iterable[str] | None = None,
    ) -> None:
        self.model = model
        self.names = None if names is None else set(names)
        self.data_rank, self.tensor_rank = coords.data, coords.tensor
        self.tensor_size = tensor_size
        self.data_size = data_size
        self.duplicates = {id(t) for t in duplicates}
        self.zero = zero
        self.masters = dict(masters or {})
        self.layout = dict(layout or {})
        self.group = group

    # ------------------------------------------------------------------- what is held
    def held(self) -> tuple[list[Held], dict[str, str]]:
        """Every tensor this rank holds (``meta`` placeholders of other stages are not), once
        each, and the aliases (``alias -> canonical name``) of tensors it holds twice."""
        zero = self.zero
        managed = {id(p) for _, p in zero.named_params()} if zero is not None else set()
        pieces = {id(p): (lo, v) for _, p, lo, _, v in zero.pieces()} if zero is not None else {}
        out: list[Held] = []
        seen: dict[int, str] = {}
        aliases: dict[str, str] = {}
        spread = _Spread(self.data_rank, self.tensor_rank)
        for name, t in self.model.state_dict(keep_vars=True).items():
            if t.is_meta or (self.names is not None and name not in self.names):
                continue
            if id(t) in seen:
                aliases[name] = seen[id(t)]
                continue
            seen[id(t)] = name
            offset, global_shape = _placement(t, self.tensor_rank, self.tensor_size)
            tensor_copies = self.tensor_size if global_shape == tuple(t.shape) else 1
            copy_rank = self.data_rank
            experts = getattr(t, EXPERT_ATTR, None)
            if experts is not None:  # experts index·n.. of the stack, held by every tensor rank
                offset, global_shape, copy_rank = _expert_placement(t, *experts, self.data_rank)
                tensor_copies = self.tensor_size
            if id(t) in managed:
                if id(t) not in pieces:
                    continue  # ZeRO keeps none of its elements on this data rank
                lo, values = pieces[id(t)]
                data_copies = 1  # each data rank holds its own piece
                optimizer_param = zero.optimizer_param(t)  # type: ignore[union-attr]
            else:
                lo = 0
                values = self.masters.get(id(t), t)
                # the replicas holding these experts: one per expert group
                data_copies = self.data_size // (experts[1] if experts else 1)
                optimizer_param = values if isinstance(t, nn.Parameter) else None
            writer = id(t) not in self.duplicates and spread.mine(
                data_copies, tensor_copies, values.numel() * values.element_size(), copy_rank
            )
            if not values.is_contiguous():
                raise ValueError(f"{name}: a checkpoint view needs contiguous storage")
            out.append(
                Held(
                    name,
                    values.detach(),
                    tuple(t.shape),
                    lo,
                    offset,
                    global_shape,
                    writer,
                    optimizer_param,
                )
            )
        return out, aliases

    # ------------------------------------------------------------------------- saving
    def state_dict(self, optimizers: Sequence[Optimizer] = (), extra: Any = None) -> dict[str, Any]:
        """This rank's part of the checkpoint: views into live storage, nothing is copied. A
        collective (the aliases of every stage are merged into rank 0's meta)."""
        held, aliases = self.held()
        owner = _owners(optimizers)
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for h in held:
            if not h.writer:
                continue
            model[h.name] = h.view(h.values)
            opt = owner.get(id(h.optimizer_param)) if h.optimizer_param is not None else None
            if opt is None:
                continue
            entry = {}
            for key, value in opt.state.get(h.optimizer_param, {}).items():
                value = local_tensor(value) if isinstance(value, Tensor) else value
                elementwise = isinstance(value, Tensor) and value.dim() > 0
                if elementwise and value.numel() == h.values.numel():
                    entry[key] = h.view(value)
                else:
                    entry[key] = value  # a scalar (AdamW's step): equal on every rank
            if entry:
                optim[h.name] = entry
        out: dict[str, Any] = {"model": model}
        if optim:
            out["optim"] = optim
        aliases = _merged(aliases, self.group)
        if not dist.is_initialized() or dist.get_rank(self.group) == 0:
            meta = {
                "format": FORMAT,
                "aliases": aliases,
                "param_groups": optimizer_settings(optimizers[0]) if optimizers else [],
                "optimizers": [optimizer_settings(o) for o in optimizers],
                "layout": self.layout,
            }
            out["meta"] = json.dumps(meta)
            if extra is not None:
                out["extra"] = pickle.dumps(extra)
        return out

    def save(self, path: Any, optimizers: Sequence[Optimizer] = (), extra: Any = None) -> None:
        """Write this rank's part to the DCP folder ``path`` (atomically; every rank calls)."""
        files.save(self.state_dict(optimizers, extra), path, self.group)

    # ------------------------------------------------------------------------ loading
    def load(self, path: Any, optimizers: Sequence[Optimizer] = ()) -> None:
        """Fill this rank's tensors (and fresh optimizer state) from ``path``, whatever layout
        wrote it; every rank calls. The caller refreshes what follows the loaded values (ZeRO's
        compute parameters, a plugin's low-precision copies) and reads ``extra`` if it wants it
        (:func:`read_extra`: a Trainer reads it before its tensors exist)."""
        md = files.metadata(path).state_dict_metadata
        held, _ = self.held()
        owner = _owners(optimizers)
        target: dict[str, Any] = {"model": {}, "meta": None}
        created: list[tuple[Optimizer, Tensor, dict[str, Tensor]]] = []
        problems: list[str] = []
        asked: set[str] = set()
        aliases: dict[str, str] | None = None  # the saved ones: read only if a name needs them
        for h in held:
            name = h.name
            if f"model.{name}" not in md:
                if aliases is None:
                    aliases = json.loads(files.read_object(path, "meta")).get("aliases", {})
                name = aliases.get(name, name)
            saved = md.get(f"model.{name}")
            if saved is None:
                problems.append(f"it lacks {h.name!r}")
                continue
            asked.add(name)
            if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != h.global_shape:
                problems.append(
                    f"{h.name!r} has shape {tuple(saved.size)} there, {h.global_shape} here"
                )
                continue
            target["model"][name] = h.view(h.values)
            opt = owner.get(id(h.optimizer_param)) if h.optimizer_param is not None else None
            if opt is not None:
                state = fresh_optimizer_state(
                    md, name, h.values, len(h.global_shape), h.view, target
                )
                created.append((opt, h.optimizer_param, state))  # type: ignore[arg-type]
        _refuse_mismatch(md, asked, problems, path, self.group)
        files.load(target, path, self.group)
        for opt, param, state in created:
            if state:
                opt.state[param] = _placed_like(param, state)
        meta = json.loads(target["meta"])
        saved_groups = meta.get("optimizers") or [meta.get("param_groups", [])]
        for opt, settings in zip(optimizers, saved_groups):
            restore_optimizer_settings(opt, settings)


def _placed_like(param: Tensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``DTensor`` parameter's (FSDP2's) element-wise state as ``DTensor``s placed like it."""
    if not isinstance(param, DTensor):
        return state
    local = param.to_local()
    return {
        k: as_dtensor_like(v, param) if v.numel() == local.numel() and v.dim() > 0 else v
        for k, v in state.items()
    }


class _Spread:
    """Which of the ranks holding equal copies of a tensor writes it: the one that has written
    the fewest bytes so far. Every holder runs the same choices on the same sequence of tensors
    (their models have equal shapes), so they agree without talking."""

    def __init__(self, data_rank: int, tensor_rank: int) -> None:
        self.data_rank, self.tensor_rank = data_rank, tensor_rank
        self.written: dict[tuple[int, int], list[int]] = {}

    def mine(
        self, data_copies: int, tensor_copies: int, nbytes: int, copy_rank: int | None = None
    ) -> bool:
        """``copy_rank``: this rank's index among the ``data_copies`` replicas holding the
        tensor (default its data rank; an expert slice's copy: its expert group)."""
        if data_copies * tensor_copies == 1:
            return True
        written = self.written.setdefault(
            (data_copies, tensor_copies), [0] * (data_copies * tensor_copies)
        )
        chosen = min(range(len(written)), key=written.__getitem__)
        written[chosen] += nbytes
        data = self.data_rank if copy_rank is None else copy_rank
        me = (data % data_copies) * tensor_copies + self.tensor_rank % tensor_copies
        return chosen == me


def _owners(optimizers: Sequence[Optimizer]) -> dict[int, Optimizer]:
    return {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}


def _gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def _merged(aliases: dict[str, str], group: dist.ProcessGroup | None) -> dict[str, str]:
    """Every stage's aliases (a tied weight is aliased on each stage that holds it)."""
    out: dict[str, str] = {}
    for part in _gather_objects(aliases, group):
        out.update(part)
    return out


def _refuse_mismatch(
    md: Mapping[str, Any],
    asked: set[str],
    problems: list[str],
    path: Any,
    group: dist.ProcessGroup | None,
) -> None:
    """Refuse a checkpoint of another model on every rank (a collective, before any tensor is
    read): a tensor a rank holds that is missing or shaped otherwise, or a checkpoint tensor no
    rank of this layout asks for (it would be dropped silently: a model with fewer layers)."""
    parts = _gather_objects((asked, problems), group)
    everyone = set().union(*(a for a, _ in parts))
    found = sorted({p for _, ps in parts for p in ps})
    left = sorted(k[len("model.") :] for k in md if k.startswith("model."))
    found += [f"it holds {k!r}, which this model has not" for k in left if k not in everyone]
    if found:
        raise KeyError(
            f"{path} does not fit this model ({len(found)} problems): {'; '.join(found[:4])}"
            f"{' ...' if len(found) > 4 else ''}"
        )


# ------------------------------------------------------------------ the format's pieces
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


# ------------------------------------------------------------------ one-process readers
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
