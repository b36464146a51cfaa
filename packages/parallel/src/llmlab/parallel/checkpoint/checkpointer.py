"""``LayoutCheckpointer``: the one door through which a split layout's state goes to disk and back.

Lightning asks a strategy for the model's state, each optimizer's state and the precision
plugin's, and hands them back on resume. In a split layout none of them is a plain state dict --
a rank holds tensor-parallel slices, one pipeline stage, ZeRO pieces, fp32 masters -- so the N-D
strategy answers each question here, in one of two formats, both keyed by the *unsplit* model's
names so that either loads into any other layout and into a plain model:

* consolidated (default): full tensors gathered by name (:mod:`.consolidated`, ZeRO's pieces
  assembled by :mod:`.zero_state`); rank 0 writes Lightning's one file.
* sharded (``sharded=True``): each rank writes only what it holds into a
  ``torch.distributed.checkpoint`` folder (:class:`~.layout_state.LayoutState`); Lightning's
  small state rides along as ``extra``.

A precision plugin's fp32 masters are consolidated by name too (``masters_by_name``), or, in a
sharded checkpoint, *are* the model values written; its scaler state is kept as it is. fp8
delayed-scaling amax histories are kept per tensor rank (:mod:`.fp8_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.checkpoint import consolidated as C
from llmlab.parallel.checkpoint.files import is_sharded
from llmlab.parallel.checkpoint.fp8_state import AMAX_KEY, add_amax, restore_amax
from llmlab.parallel.checkpoint.fsdp2_state import (
    fsdp2_full_optimizer_state,
    fsdp2_full_params,
    load_fsdp2_full_optimizer_state,
    load_fsdp2_full_params,
)
from llmlab.parallel.checkpoint.layout_state import LayoutState, read_extra
from llmlab.parallel.checkpoint.zero_state import (
    load_zero_full_optimizer_state,
    load_zero_full_params,
    zero_full_optimizer_state,
    zero_full_params,
)
from llmlab.parallel.data.fsdp2 import FSDP2Engine
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.mesh import ProcessGroups
from llmlab.parallel.precision.master import MasterWeights

SHARDED_KEY = "llmlab_sharded_checkpoint"  # a loaded checkpoint's marker: its DCP folder


class LayoutCheckpointer:
    """Checkpoint state of one rank of a split layout.

    Args:
        module: the LightningModule; its ``<model_attribute>`` is the split model.
        groups: this rank's process groups (their ``dims`` is the layout).
        duplicates: tied copies held here that another stage owns (written there).
        zero: the ZeRO engine (llmlab's, or FSDP2's), whose pieces stand for the parameters
            it manages.
        masters: a precision plugin's fp32 masters (without ZeRO: with it, the engine's pieces
            are the masters).
        sharded: write a DCP folder per checkpoint instead of one gathered file.
        layout: recorded in a sharded checkpoint's meta, for people reading it.
    """

    def __init__(
        self,
        module: nn.Module,
        model_attribute: str,
        groups: ProcessGroups,
        duplicates: Sequence[Tensor] = (),
        zero: ZeroEngine | FSDP2Engine | None = None,
        masters: MasterWeights | None = None,
        sharded: bool = False,
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        self.module = module
        self.model_attribute = model_attribute
        self.groups = groups
        self.duplicates = list(duplicates)
        self.zero = zero
        self.masters = masters if zero is None else None
        self.sharded = sharded
        self.layout = dict(layout or {})

    # ---------------------------------------------------------------- the model
    def model_state(self) -> dict[str, Any]:
        """The unsplit model's state dict, full tensors (a collective). Sharded: only what
        lies outside the model (the model goes to :meth:`save`'s folder)."""
        if self.sharded:
            prefix = f"{self.model_attribute}."
            return {k: v for k, v in self.module.state_dict().items() if not k.startswith(prefix)}
        named = C.named_state(self.module)
        if self.zero is not None:  # the fp32 masters, assembled from the data shards
            fsdp2 = isinstance(self.zero, FSDP2Engine)
            full = (fsdp2_full_params if fsdp2 else zero_full_params)(self.zero)
            value = {id(p): full[n] for n, p in self.zero.named_params()}
            named = {k: (value.get(id(t), t), dim) for k, (t, dim) in named.items()}
        return C.gather_full(named, self.groups.tensor, self.groups.pipeline, self.groups.expert)

    def load_model_state(
        self, checkpoint: Mapping[str, Any], optimizers: Sequence[Optimizer], strict: bool = True
    ) -> None:
        """Full weights sliced to this rank (ZeRO: each rank copies its pieces into its master
        shard); or a sharded checkpoint's model *and* optimizer state, read where every tensor
        lives."""
        if SHARDED_KEY in checkpoint:
            self.module.load_state_dict(checkpoint["state_dict"], strict=False)  # the rest
            self._load_sharded(checkpoint[SHARDED_KEY], optimizers)
        else:
            self._load_full_model_state(checkpoint, strict)
        if AMAX_KEY in checkpoint:  # after the model state: it holds tensor rank 0's histories
            restore_amax(self.module, checkpoint[AMAX_KEY], self.groups)

    def _load_full_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        named = C.named_state(self.module)
        slices = C.local_slices(
            checkpoint["state_dict"], named, self.groups.tensor, strict, self.groups.expert
        )
        if self.zero is not None:
            name_of = {id(p): n for n, p in self.zero.named_params()}
            ours = {k for k in slices if id(named[k][0]) in name_of}
            load = load_fsdp2_full_params if isinstance(self.zero, FSDP2Engine) else None
            (load or load_zero_full_params)(
                self.zero, {name_of[id(named[k][0])]: slices[k] for k in ours}
            )
            slices = {k: v for k, v in slices.items() if k not in ours}
        C.load_local_(named, slices)

    # ------------------------------------------------------------ the optimizers
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter name at full shape (a collective). Sharded: a
        marker (the state is written by :meth:`save`, shard by shard)."""
        if self.sharded:
            return {"format": SHARDED_KEY}
        if self.zero is None:
            return C.optimizer_state(
                optimizer,
                self._param_info(),
                self.groups.tensor,
                self.groups.pipeline,
                self.groups.expert,
            )
        info = self._param_info()
        by_name = dict(self.zero.named_params())
        fsdp2 = isinstance(self.zero, FSDP2Engine)
        full = (fsdp2_full_optimizer_state if fsdp2 else zero_full_optimizer_state)(
            self.zero, optimizer
        )
        kept = [(p, optimizer.state[p]) for p in self._kept() if p in optimizer.state]
        tensors, scalars = C.split_state([*((by_name[n], e) for n, e in full.items()), *kept], info)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [info[id(p)][0] for p in members]}
            for g, members in zip(
                optimizer.param_groups, self.zero.group_members(optimizer), strict=True
            )
        ]  # fmt: skip
        return C.named_optimizer_state(
            tensors, scalars, groups, self.groups.tensor, self.groups.pipeline, self.groups.expert
        )

    def load_optimizer_state(self, optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
        """A consolidated optimizer state (or a plain one from a one-process run) into this
        rank's optimizer. A sharded checkpoint's was loaded with the model."""
        if saved.get("format") == SHARDED_KEY:
            return
        if saved.get("format") != C.FORMAT:  # a plain state: by position, at full shapes
            optimizer.load_state_dict(
                C.local_plain_optimizer_state(
                    optimizer, saved, self.groups.tensor, self.groups.expert
                )
            )
        elif self.zero is None:
            C.load_optimizer_state(
                optimizer, saved, self._param_info(), self.groups.tensor, self.groups.expert
            )
        else:
            self._load_zero_optimizer_state(optimizer, saved)

    def _load_zero_optimizer_state(self, optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
        zero = self.zero
        assert zero is not None
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved['param_groups'])} optimizer parameter groups, this "
                f"optimizer {len(optimizer.param_groups)}"
            )
        info = self._param_info()
        named, full = {}, {}
        for _, p in zero.named_params():
            name, dim = info[id(p)]
            for key, value in saved["state"].get(name, {}).items():
                if isinstance(value, Tensor) and value.dim() == p.dim() and value.dim() > 0:
                    named[f"{name}\0{key}"] = (p, dim)  # the shape of this rank's tensor
                    full[f"{name}\0{key}"] = value
        slices = C.local_slices(full, named, self.groups.tensor, expert_group=self.groups.expert)
        state = {
            ename: {
                key: slices.get(f"{info[id(p)][0]}\0{key}", value)
                for key, value in saved["state"].get(info[id(p)][0], {}).items()
            }
            for ename, p in zero.named_params()
        }
        fsdp2 = isinstance(zero, FSDP2Engine)
        (load_fsdp2_full_optimizer_state if fsdp2 else load_zero_full_optimizer_state)(
            zero, optimizer, state
        )
        self._load_kept_optimizer_state(optimizer, saved, info)
        for group, sg in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in sg.items() if k != "params"})

    def _kept(self) -> list[nn.Parameter]:
        """What the optimizer steps beside the engine's pieces: expert slices, whole."""
        return list(getattr(self.zero, "kept", ()))

    def _load_kept_optimizer_state(
        self, optimizer: Optimizer, saved: Mapping[str, Any], info: Mapping[int, Any]
    ) -> None:
        """This rank's slices of the saved state of the parameters the engine keeps whole."""
        kept = [p for p in self._kept() if info[id(p)][0] in saved["state"]]
        named, full = {}, {}
        for p in kept:
            name, dim = info[id(p)]
            for key, value in saved["state"][name].items():
                if isinstance(value, Tensor) and value.dim() == p.dim() and value.dim() > 0:
                    named[f"{name}\0{key}"] = (p, dim)
                    full[f"{name}\0{key}"] = value
        slices = C.local_slices(full, named, self.groups.tensor, expert_group=self.groups.expert)
        for p in kept:
            name = info[id(p)][0]
            optimizer.state[p] = {
                key: slices[f"{name}\0{key}"].to(p.device) if f"{name}\0{key}" in slices
                else value
                for key, value in saved["state"][name].items()
            }  # fmt: skip

    def _param_info(self) -> dict[int, tuple[str, int | None]]:
        """``id(optimizer parameter) -> (state-dict name, shard dim)``, masters included."""
        info: dict[int, tuple[str, int | None]] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            info.setdefault(id(t), (name, C.shard_dim(t)))
        for master_id, p in self.model_param_of().items():
            info[master_id] = info[id(p)]
        return info

    def model_param_of(self) -> dict[int, nn.Parameter]:
        """``id(what the optimizer steps) -> model parameter``: ZeRO's pieces or the plugin's
        fp32 masters (empty when the optimizer steps the model's parameters)."""
        if self.zero is not None:
            return self.zero.model_param_of()
        return self.masters.model_param_of() if self.masters is not None else {}

    # --------------------------------------------------------- the precision plugin
    def prepare_save(self, checkpoint: dict[str, Any], plugin_key: str) -> None:
        """Before writing (a collective): the plugin's state under ``plugin_key`` as
        :meth:`precision_state` keeps it, and every tensor rank's fp8 amax histories."""
        if plugin_key in checkpoint:
            checkpoint[plugin_key] = self.precision_state(checkpoint[plugin_key])
        add_amax(checkpoint, self.module, self.groups)

    def prepare_load(self, checkpoint: dict[str, Any], plugin_key: str) -> None:
        """After reading: the plugin's state as :meth:`load_precision_state` gives it back (the
        amax histories follow the model state in :meth:`load_model_state`)."""
        if plugin_key in checkpoint:
            checkpoint[plugin_key] = self.load_precision_state(checkpoint[plugin_key])

    def precision_state(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """A precision plugin's state with its fp32 masters by name, gathered (a collective);
        sharded, without them (they are the checkpoint's model values). Scaler state as is."""
        rest = {k: v for k, v in local.items() if k != "masters"}
        if "masters" not in local or self.sharded or self.masters is None:
            return rest
        full = C.gather_full(
            self._masters_named(), self.groups.tensor, self.groups.pipeline, self.groups.expert
        )
        return {**rest, "masters_by_name": full}

    def load_precision_state(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse: this rank's slices of the masters, in the plugin's own order."""
        if "masters_by_name" not in saved:
            return dict(saved)
        named = self._masters_named()
        slices = C.local_slices(
            saved["masters_by_name"], named, self.groups.tensor, expert_group=self.groups.expert
        )
        rest = {k: v for k, v in saved.items() if k != "masters_by_name"}
        return {**rest, "masters": [slices[name] for name in named]}

    def _masters_named(self) -> dict[str, tuple[Tensor, int | None]]:
        assert self.masters is not None
        info = self._param_info()
        return {info[id(m)][0]: (m, info[id(m)][1]) for m in self.masters.masters}

    # ------------------------------------------------------------- sharded files
    def save(self, checkpoint: dict[str, Any], path: Any, optimizers: Sequence[Optimizer]) -> None:
        """Every rank writes its shards into the folder ``path`` (atomically), rank 0 also
        Lightning's small state."""
        optimizers = optimizers if "optimizer_states" in checkpoint else []
        self._layout_state().save(path, optimizers, checkpoint)

    @staticmethod
    def read(path: Any) -> dict[str, Any] | None:
        """Lightning's small state of a sharded checkpoint, marked with its folder (the tensors
        follow in :meth:`load_model_state`); ``None`` when ``path`` is not sharded."""
        if not is_sharded(path):
            return None
        checkpoint = read_extra(path)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise ValueError(
                f"{path} is a sharded checkpoint without a Trainer's state (written by "
                "save_zero?): resume from a Trainer checkpoint, or consolidate it and load the "
                "weights yourself"
            )
        return {**checkpoint, SHARDED_KEY: str(path)}

    def _load_sharded(self, path: str, optimizers: Sequence[Optimizer]) -> None:
        """Model and optimizer state into this rank's tensors, then the copies that follow them
        (ZeRO's compute parameters, a plugin's fp16/bf16 model)."""
        self._layout_state().load(path, optimizers)
        if self.zero is not None:
            self.zero.refresh_params()
        elif self.masters is not None:
            self.masters.copy_to_model()

    def _layout_state(self) -> LayoutState:
        if isinstance(self.zero, FSDP2Engine):  # zero=2 keeps units gathered after a no-grad
            self.zero.refresh_params()  # forward (validation): the shards are what is saved
        masters = {}
        if self.masters is not None:
            pairs = zip(self.masters.model_params, self.masters.masters, strict=True)
            masters = {id(p): m for p, m in pairs}
        coords, dims = self.groups.coords, self.groups.dims
        # context ranks hold equal weights: with the data replicas they share the writing
        coords = coords._replace(data=coords.data * dims.context + coords.context)
        prefix = f"{self.model_attribute}."  # the model's tensors the module's state keeps
        names = [k[len(prefix) :] for k in self.module.state_dict(keep_vars=True)
                 if k.startswith(prefix)]  # fmt: skip
        return LayoutState(
            getattr(self.module, self.model_attribute),
            coords,
            dims.tensor,
            data_size=dims.replicas,
            duplicates=self.duplicates,
            zero=self.zero,
            masters=masters,
            layout=self.layout,
            names=names,
        )
