"""ZeRO-1/2/3 on one data-parallel group: shard what data parallelism replicates.

Per replica, ``N`` parameters trained with AdamW in fp32 cost 16 bytes each under DDP (4 weight,
4 gradient, 8 for the two moments). With ``n`` data ranks (ZeRO, Rajbhandari et al. 2020):

    stage 0 (DDP)   16·N          all-reduce the gradients
    stage 1         8·N + 8·N/n   reduce-scatter the gradients; each rank steps its shard of the
                                  flat buffer; all-gather the parameters
    stage 2         4·N + 12·N/n  ... and free each unit's full gradients once reduce-scattered
    stage 3         16·N/n        ... and keep only the parameter shard: a unit's full parameters
                                  are all-gathered just before its forward and again before its
                                  backward, freed after, the next unit's gather prefetched

while the arithmetic -- and so the loss curve -- stays DDP's on the same global batch.

The engine works on one process group and one module's parameters (a whole model, a pipeline
stage, or a tensor-parallel shard: it never assumes either is the world or the whole model):

* Units and shards: :mod:`llmlab.parallel.data.zero_layout`. Gradients are reduced unit by unit
  as backward produces them (a ``post_accumulate_grad`` hook per parameter), at most one
  reduction in flight besides the one being launched, and the step's end is an autograd
  end-of-backward callback -- no call to forget.
* Gradient accumulation: inside :meth:`no_sync` nothing is reduced (gradients accumulate in
  full), and the boundary micro-batch reduces once, exactly like DDP's ``no_sync``.
* The optimizer: :meth:`rewire` points each param group at this rank's pieces (the way
  :class:`~llmlab.parallel.precision.master.MasterWeights` points them at fp32 masters), so a
  Lightning ``optimizer.step()`` steps only the shard; a step post-hook then all-gathers the new
  parameters (stages 1-2) or just refreshes the compute shard (stage 3, gathered lazily).
* Clipping: :meth:`clip_grad_norm_` by the norm of the shards summed over the data group, from
  :func:`llmlab.parallel.norm.global_grad_norm` (the one norm every strategy uses).
* Mixed precision: give the engine a model already cast to bf16/fp16 (and the fp32 values it had,
  ``initial``); at stages 1-3 it keeps the fp32 master *shards* itself, so the precision plugin
  keeps only the loss scale (:class:`~llmlab.parallel.data.zero_precision.ZeroMasterWeights`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from llmlab.parallel.buffers import FlatBuffer
from llmlab.parallel.data.zero_layout import (
    REST,
    Piece,
    Unit,
    build_unit,
    check_stage3_sharing,
    partition,
    stage3_segments,
)
from llmlab.parallel.norm import clip_by_total_norm_, global_grad_norm

STAGES = (0, 1, 2, 3)

# torch 2.13 renamed the tensor collectives; older versions only have the first names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _queue_end_of_backward(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class ZeroEngine:
    """ZeRO ``stage`` over ``group`` for the trainable parameters of ``module``.

    Args:
        module: the local model (whole, a pipeline stage, a tensor-parallel shard).
        stage: 0 (DDP), 1, 2 or 3.
        group: the data-parallel process group (``None``: the default group).
        blocks: the units ZeRO-3 gathers one at a time; default ``module.repeated_blocks()``
            when the module has it (the ``HasRepeatedBlocks`` contract), else none.
        named_params: the ``(name, parameter)`` pairs to manage, named as in the *unsharded*
            model (checkpoint keys); default ``module.named_parameters()`` that require grad.
        master_dtype: dtype of the shards the optimizer steps (stages 1-3).
        reduce_dtype: dtype gradients are reduced in; default the parameters' dtype.
        initial: ``id(param) -> value`` before the model was cast down (exact masters).
        prefetch: ZeRO-3 gathers the next unit while the current one computes.
        reduce_in_backward: reduce each unit as backward finishes it (hooks). ``False`` for a
            caller that combines several backward passes' gradients itself (a pipeline
            schedule) and then calls :meth:`reduce_gradients` once per step; backward is then
            left entirely alone.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        group: dist.ProcessGroup | None = None,
        *,
        blocks: Sequence[nn.Module] | None = None,
        named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        master_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        initial: Mapping[int, Tensor] | None = None,
        prefetch: bool = True,
        reduce_in_backward: bool = True,
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs torch.distributed initialised (any backend)")
        self.module = module
        self.stage = stage
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.prefetch = prefetch
        if blocks is None:
            get = getattr(module, "repeated_blocks", None)
            blocks = list(get()) if callable(get) else []
        if named_params is None:
            named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            canonical = {id(p): n for n, p in named_params}
            self.aliases = {
                alias: canonical[id(p)]
                for alias, p in module.named_parameters(remove_duplicate=False)
                if id(p) in canonical and alias != canonical[id(p)]
            }
        else:
            self.aliases = {}
        seen: set[int] = set()
        unique = []
        for n, p in named_params:  # a tied parameter is one parameter, named once
            if id(p) not in seen:
                seen.add(id(p))
                unique.append((n, p))
        if not unique:
            raise ValueError("ZeroEngine got no trainable parameters to shard")
        self.units: list[Unit] = [
            build_unit(
                i,
                name,
                named,
                stage=stage,
                rank=self.rank,
                world=self.world,
                group=self.group,
                master_dtype=master_dtype,
                initial=initial or {},
            )
            for i, (name, named) in enumerate(partition(unique, blocks))
        ]
        self.reduce_dtype = reduce_dtype
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._slot = {id(p): i for u in self.units for i, p in enumerate(u.params)}
        self._piece_of = {id(pc.param): pc for u in self.units for pc in u.pieces}
        self.sync = True  # False inside no_sync(): accumulate, do not reduce
        self._callback_queued = False
        self._in_backward = False
        self._events: list[int] = []  # stage 3: units in the order this step used them
        self._plan: list[int] | None = None  # ... and in the previous step (prefetch order)
        self._live = 0  # model-state bytes besides optimizer state, right now (for the peak)
        self._optim_bytes = 0  # optimizer state, re-measured after each step
        self._full_grads: set[int] = set()  # stages 2-3: parameters holding a full gradient
        self.peak_bytes = 0
        self._optimizers: list[Optimizer] = []
        self._members: dict[int, list[list[nn.Parameter]]] = {}  # param groups before rewire
        self.comm_bytes = 0  # payload of every collective this engine ran (reset by the caller)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for u in self.units
            for p in u.params
            if reduce_in_backward
        ]
        if stage >= 3:
            if not reduce_in_backward:
                raise ValueError(
                    "ZeRO-3 gathers and frees parameters around each backward pass, so it must "
                    "reduce in backward too (reduce_in_backward=True)"
                )
            self._install_stage3_hooks(module, blocks)
        self._live = self._persistent_bytes()
        self.peak_bytes = self._live

    # ================================================================ the optimizer
    def rewire(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at this rank's pieces and all-gather after each
        step. Stage 0 leaves the optimizer on the full parameters. Must run before any state."""
        if optimizer in self._optimizers:
            return  # Lightning connects again for validate/test
        self._members[id(optimizer)] = [list(g["params"]) for g in optimizer.param_groups]
        if self.stage >= 1:
            if len(optimizer.state) > 0:
                raise RuntimeError(
                    "ZeroEngine.rewire needs a fresh optimizer, but it already holds state for "
                    f"{len(optimizer.state)} parameters; rewire before the first step"
                )
            managed = set(self._unit_of)
            for gi, group in enumerate(optimizer.param_groups):
                new = []
                for p in group["params"]:
                    if id(p) not in managed:
                        raise ValueError(
                            f"optimizer param group {gi} holds a parameter of shape "
                            f"{tuple(p.shape)} that this ZeroEngine does not manage"
                        )
                    piece = self._piece_of.get(id(p))
                    if piece is not None:  # else: none of its elements live on this rank
                        new.append(piece.master)
                group["params"] = new
            optimizer.register_step_post_hook(lambda *_: self.refresh_params())
        optimizer.register_step_post_hook(lambda *_: self._measure_optimizer())
        self._optimizers.append(optimizer)

    def group_members(self, optimizer: Optimizer) -> list[list[nn.Parameter]]:
        """The model parameters of each of ``optimizer``'s param groups, as before ``rewire``."""
        return self._members[id(optimizer)]

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Make the compute parameters follow the master shards (after a step or a load)."""
        if self.stage == 0:
            return
        works = []
        for u in self.units:
            if u.master is not u.shard:
                u.shard.copy_(u.master)  # fp32 master -> bf16/fp16 compute shard
            if self.stage >= 3:
                if u.gathered:
                    self._free(u)  # stale: gathered again when next used
            elif self.world > 1:
                self.comm_bytes += u.full.nbytes
                works.append(_all_gather(u.full.data, u.shard, group=self.group, async_op=True))
            # one data rank at stages 1-2: the shard is the full buffer, already up to date
        for w in works:
            w.wait()

    # ================================================================ gradients
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batches: keep accumulating the full gradients locally."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _begin_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._in_backward = True
            _queue_end_of_backward(self._end_of_backward)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._begin_backward()
        u = self._unit_of[id(p)]
        if u.grads is not None:  # stages 0-1: gradients live in the flat buffer
            view = u.grads.views[self._slot[id(p)]]
            if p.grad.data_ptr() != view.data_ptr():  # autograd made a fresh one (after
                view.copy_(p.grad)  # zero_grad(set_to_none)): move it into the buffer
                p.grad = view
        elif id(p) not in self._full_grads:
            self._full_grads.add(id(p))
            self._track(p.grad.numel() * p.grad.element_size())
        u.ready += 1
        if u.ready == len(u.params) and self.sync:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """Launch unit ``u``'s reduction; wait for the previous one first (bounded memory)."""
        for other in self.units:
            if other.pending is not None:
                self._complete(other)
        n = self.world
        rdt = self.reduce_dtype
        keep: list[Tensor] = []
        if self.stage == 0:
            flat = u.grads.data.div_(n)  # average as DDP does: divide, then sum
            work = dist.all_reduce(flat, group=self.group, async_op=True) if n > 1 else None
        else:
            if u.grads is not None:  # stage 1: the persistent full-gradient buffer
                flat = u.grads.data.div_(n)
                if rdt is not None and rdt != flat.dtype:
                    flat = flat.to(rdt)
            else:  # stages 2-3: pack autograd's gradients, then free them
                tmp = FlatBuffer(u.params, pad_to=n, dtype=rdt)
                for view, p in zip(tmp.views, u.params):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        if id(p) in self._full_grads:
                            self._full_grads.discard(id(p))
                            self._track(-p.grad.numel() * p.grad.element_size())
                        p.grad = None
                flat = tmp.data.div_(n)
                self._track(tmp.nbytes)
                keep.append(flat)
            out = (
                u.grad_shard if flat.dtype == u.grad_shard.dtype else flat.new_empty(u.shard_numel)
            )
            keep.append(out)
            if n > 1:
                work = _reduce_scatter(out, flat, group=self.group, async_op=True)
            else:
                out.copy_(flat)
                work = None
        if n > 1:
            self.comm_bytes += flat.numel() * flat.element_size()
        u.pending = (work, keep)
        u.reduced = True

    def _complete(self, u: Unit) -> None:
        work, keep = u.pending
        if work is not None:
            work.wait()
        u.pending = None
        if self.stage == 0:
            return
        out = keep[-1]
        if out is not u.grad_shard:
            u.grad_shard.copy_(out)
        if u.grads is not None:
            u.grads.data.zero_()  # stage 1: consumed; the next window accumulates from zero
        else:
            self._track(-keep[0].numel() * keep[0].element_size())
        for pc in u.pieces:
            at = u.full.offsets[self._slot[id(pc.param)]] + pc.lo - u.start
            pc.master.grad = u.grad_shard[at : at + pc.hi - pc.lo]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce every unit now, from whatever ``.grad`` holds (missing ones count as zero).

        For callers that run several backward passes per step and combine gradients themselves
        before the reduction (a pipeline schedule, tied weights summed across stages): they keep
        ``sync`` False so that backward reduces nothing, then call this once per step.
        """
        for u in self.units:
            if u.grads is not None:
                for p, view in zip(u.params, u.grads.views):
                    if p.grad is None:
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                    p.grad = view
            self._reduce(u)
        for u in self.units:
            if u.pending is not None:
                self._complete(u)
            u.ready = 0
            u.reduced = False

    def _end_of_backward(self) -> None:
        """Autograd's end-of-backward callback: finish every reduction, free what ZeRO-3 holds."""
        self._callback_queued = False
        self._in_backward = False
        if self.sync:
            for u in self.units:
                if not u.reduced:  # parameters that took no part in this loss
                    self._reduce(u)
            for u in self.units:
                if u.pending is not None:
                    self._complete(u)
        for u in self.units:
            u.ready = 0
            u.reduced = False
        if self.stage >= 3:
            for u in self.units:
                if u.gathered or u.gather_work is not None:
                    self._free(u)
            self._plan, self._events = self._events, []

    # ================================================================ ZeRO-3 gathering
    def _install_stage3_hooks(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        users: dict[int, list[nn.Module]] = {}
        by_name = {u.name: u for u in self.units}
        for b, block in enumerate(blocks):
            if f"block{b}" in by_name:
                users[by_name[f"block{b}"].index] = [block]
        if REST in by_name:
            rest = by_name[REST]
            users[rest.index] = stage3_segments(module, blocks, {id(p) for p in rest.params})
        check_stage3_sharing(self.units, users)
        for index, modules in users.items():
            for m in modules:
                self._handles.append(
                    m.register_forward_pre_hook(lambda *_, i=index: self._pre_forward(i))
                )
                self._handles.append(
                    m.register_forward_hook(lambda _m, _a, out, i=index: self._post_forward(i, out))
                )
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(module.register_forward_hook(self._root_post_forward))

    def _root_pre_forward(self, *_: Any) -> None:
        if not self._in_backward:
            self._events = []

    def _root_post_forward(self, *_: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will come to free them
            for u in self.units:
                if u.gathered or u.gather_work is not None:
                    self._free(u)
            self._events = []

    def _pre_forward(self, index: int) -> None:
        if self._in_backward:  # recomputation (activation checkpointing) inside backward
            self._ensure_gathered(self.units[index])
        else:
            self._event(index)

    def _post_forward(self, index: int, output: Any) -> None:
        if self._in_backward or not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        fired = [False]

        def pre_backward(grad: Tensor) -> None:
            if not fired[0]:  # once per use, whichever output's gradient arrives first
                fired[0] = True
                self._begin_backward()
                self._event(index)

        for t in tensors:
            t.register_hook(pre_backward)

    def _event(self, index: int) -> None:
        """Unit ``index`` is about to run: keep it and the next one gathered, free the rest."""
        pos = len(self._events)
        self._events.append(index)
        nxt = None
        plan = self._plan
        if self.prefetch and plan is not None and pos < len(plan) and plan[pos] == index:
            nxt = next((j for j in plan[pos + 1 :] if j != index), None)
        for u in self.units:
            if u.index not in (index, nxt) and (u.gathered or u.gather_work is not None):
                self._free(u)
        self._ensure_gathered(self.units[index])
        if nxt is not None and not self.units[nxt].gathered:
            self._start_gather(self.units[nxt])

    def _start_gather(self, u: Unit) -> None:
        u.full.allocate()
        self._track(u.full.nbytes)
        if self.world > 1:
            self.comm_bytes += u.full.nbytes
            u.gather_work = _all_gather(u.full.data, u.shard, group=self.group, async_op=True)
        else:
            u.full.data.copy_(u.shard)

    def _ensure_gathered(self, u: Unit) -> None:
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
        elif not u.gathered:
            self._start_gather(u)
            if u.gather_work is not None:
                u.gather_work.wait()
                u.gather_work = None

    def _free(self, u: Unit) -> None:
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
        if u.gathered:
            u.full.free()
            self._track(-u.full.nbytes)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """All full parameters present (ZeRO-3), e.g. to evaluate or export; freed after."""
        if self.stage < 3:
            yield
            return
        for u in self.units:
            self._ensure_gathered(u)
        try:
            yield
        finally:
            for u in self.units:
                self._free(u)

    # ================================================================ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the sharded gradients; returns the norm of
        every parameter the engine manages (:func:`~llmlab.parallel.norm.global_grad_norm` of
        the shards, summed over the data group)."""
        grads = self.optimizer_grads()
        groups = [self.group] if self.stage >= 1 and self.world > 1 else []
        total = global_grad_norm(grads, [1.0] * len(grads), groups, norm_type)
        clip_by_total_norm_(grads, total, max_norm)
        return total

    @torch.no_grad()
    def scale_grads_(self, factor: Tensor | float) -> None:
        """Multiply the gradients the optimizer will read (a clip, or 1/loss-scale)."""
        for g in self.optimizer_grads():
            g.mul_(factor.to(g.dtype) if isinstance(factor, Tensor) else factor)

    def optimizer_grads(self) -> list[Tensor]:
        if self.stage == 0:
            return [p.grad for u in self.units for p in u.params if p.grad is not None]
        return [u.grad_shard for u in self.units]

    # ================================================================ inspection
    def pieces(self) -> Iterator[tuple[str, nn.Parameter, int, int, Tensor]]:
        """``(name, model parameter, lo, hi, values)``: what this rank holds of each parameter
        (the fp32 master piece, or the whole parameter at stage 0)."""
        for u in self.units:
            if self.stage == 0:
                for name, p in zip(u.names, u.params):
                    yield name, p, 0, p.numel(), p
            else:
                for pc in u.pieces:
                    yield pc.name, pc.param, pc.lo, pc.hi, pc.master

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter | None:
        """The tensor the optimizer steps for ``param`` on this rank (``None``: no elements)."""
        if self.stage == 0:
            return param
        piece: Piece | None = self._piece_of.get(id(param))
        return piece.master if piece is not None else None

    @torch.no_grad()
    def full_params(self) -> dict[str, Tensor]:
        """Every parameter in full (master precision), assembled from the shards: a collective."""
        if self.stage == 0:
            return {n: p.detach().clone() for u in self.units for n, p in zip(u.names, u.params)}
        return self._gather_by_name(
            {id(pc.param): pc.master for u in self.units for pc in u.pieces}
        )

    def _gather_by_name(
        self, values: Mapping[int, Tensor], dtype: torch.dtype | None = None
    ) -> dict[str, Tensor]:
        """``values[id(param)]`` is this rank's 1-D piece of a parameter; all-gather each unit
        over the group and return every parameter at its (local) full shape, by name."""
        out: dict[str, Tensor] = {}
        for u in self.units:
            shard = torch.zeros(
                u.shard_numel, dtype=dtype or u.master.dtype, device=u.master.device
            )
            for pc in u.pieces:
                v = values.get(id(pc.param))
                if v is not None:
                    at = u.full.offsets[self._slot[id(pc.param)]] + pc.lo - u.start
                    shard[at : at + pc.hi - pc.lo].copy_(v.reshape(-1))
            flat = shard.new_empty(u.full.data.numel())
            _all_gather(flat, shard, group=self.group)
            for name, offset, p in zip(u.names, u.full.offsets, u.params):
                out[name] = flat[offset : offset + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load_full_params(self, values: Mapping[str, Tensor]) -> None:
        """Set parameters from full (local-shape) tensors by name: each rank copies its pieces
        into its master shard, then the compute parameters follow."""
        missing = [n for u in self.units for n in u.names if n not in values]
        if missing:
            raise KeyError(f"no value for {len(missing)} parameters, e.g. {missing[:4]}")
        if self.stage == 0:
            for u in self.units:
                for name, p in zip(u.names, u.params):
                    p.copy_(values[name])
            return
        for u in self.units:
            for pc in u.pieces:
                pc.master.copy_(values[pc.name].reshape(-1)[pc.lo : pc.hi])
        self.refresh_params()

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, dict[str, Any]]:
        """``optimizer``'s state by parameter name at the parameters' (local) full shapes: the
        pieces' element-wise state all-gathered over the group, scalars (AdamW's ``step``) taken
        from this rank's pieces (they are equal everywhere). A collective."""
        if self.stage == 0:
            raise ValueError("at ZeRO stage 0 the optimizer holds the full parameters already")
        keys: dict[str, Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for u in self.units:
            for pc in u.pieces:
                for key, value in optimizer.state.get(pc.master, {}).items():
                    if (
                        isinstance(value, Tensor)
                        and value.dim() == 1
                        and value.numel() == (pc.hi - pc.lo)
                    ):
                        keys.setdefault(key, value)
                    else:
                        scalars.setdefault(pc.name, {})[key] = value
        # every rank must run the same gathers: agree on the element-wise keys
        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, sorted(keys), group=self.group)
        all_keys = sorted({k for part in names for k in part})
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, scalars, group=self.group)
        out: dict[str, dict[str, Any]] = {}
        for part in parts:
            for name, entry in part.items():
                out.setdefault(name, {}).update(entry)
        for key in all_keys:
            values = {
                id(pc.param): optimizer.state[pc.master][key]
                for u in self.units
                for pc in u.pieces
                if key in optimizer.state.get(pc.master, {})
            }
            dtype = keys[key].dtype if key in keys else self.units[0].master.dtype
            for name, tensor in self._gather_by_name(values, dtype).items():
                out.setdefault(name, {})[key] = tensor
        return out

    @torch.no_grad()
    def load_full_optimizer_state(
        self, optimizer: Optimizer, state: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """The inverse of :meth:`full_optimizer_state`: each piece gets its elements."""
        for u in self.units:
            for pc in u.pieces:
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
        self._measure_optimizer()

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, model parameter)`` for every parameter this engine manages."""
        return [(n, p) for u in self.units for n, p in zip(u.names, u.params)]

    def model_param_of(self) -> dict[int, nn.Parameter]:
        """``id(optimizer tensor) -> model parameter`` (the pieces, at stages 1-3)."""
        return {id(pc.master): pc.param for u in self.units for pc in u.pieces}

    # ================================================================ memory accounting
    def _persistent_bytes(self) -> int:
        m = self.memory_stats()
        return int(m["memory/params_bytes"] + m["memory/grads_bytes"]) + self._masters_bytes()

    def _masters_bytes(self) -> int:
        return sum(u.master.nbytes for u in self.units if u.master is not u.shard)

    def _track(self, delta: int) -> None:
        self._live += delta
        self.peak_bytes = max(self.peak_bytes, self._live + self._optim_bytes)

    def _measure_optimizer(self) -> None:
        seen: set[int] = set()
        total = 0
        for opt in self._optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, Tensor) and v.data_ptr() not in seen:
                        seen.add(v.data_ptr())
                        total += v.numel() * v.element_size()
        self._optim_bytes = total
        self._track(0)

    def memory_stats(self) -> dict[str, float]:
        """Per-rank model-state bytes: what a strategy logs each step.

        params: the compute parameters this rank keeps (full at stages 0-2, the shard at 3);
        grads: gradient buffers kept across steps (full at 0-1, plus the shard at 1-3);
        optim: optimizer state plus separate fp32 master shards (mixed precision);
        peak: the most model-state bytes held at once, counting ZeRO-3's gathered units and
        reductions in flight (activations are not model state and are not counted).
        """
        params = sum(u.shard.nbytes if self.stage >= 3 else u.full.nbytes for u in self.units)
        grads = sum(
            (u.grads.nbytes if u.grads is not None else 0)
            + (u.grad_shard.nbytes if u.grad_shard is not None else 0)
            for u in self.units
        )
        self._measure_optimizer()
        optim = self._optim_bytes + self._masters_bytes()
        return {
            "memory/params_bytes": float(params),
            "memory/grads_bytes": float(grads),
            "memory/optim_bytes": float(optim),
            "memory/peak_bytes": float(self.peak_bytes),
        }

    def padding_elements(self) -> int:
        """Zeros added so every unit splits into equal shards (at most ``n - 1`` per unit)."""
        return sum(u.full.data.numel() - u.full.numel for u in self.units)

    def close(self) -> None:
        """Remove every hook and leave the module a plain one: at stage 3 every unit is gathered
        first, so the module holds all its parameters again."""
        if self.stage >= 3:
            for u in self.units:
                self._ensure_gathered(u)
        for h in self._handles:
            h.remove()
        self._handles = []
