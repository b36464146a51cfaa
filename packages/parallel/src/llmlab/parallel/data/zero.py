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
stage, or a tensor-parallel shard: it never assumes either is the world or the whole model).
Its parts, one job each:

* units and shards: :mod:`llmlab.parallel.data.zero_layout`;
* gradients (here): reduced unit by unit as backward produces them (a ``post_accumulate_grad``
  hook per parameter), at most one reduction in flight besides the one being launched, and the
  step's end is an autograd end-of-backward callback -- no call to forget. Inside
  :meth:`no_sync` nothing is reduced (gradients accumulate in full), and the boundary
  micro-batch reduces once, exactly like DDP's ``no_sync``;
* the optimizer (here): :meth:`rewire` points each param group at this rank's pieces (the way
  :class:`~llmlab.parallel.precision.master.MasterWeights` points them at fp32 masters), so a
  Lightning ``optimizer.step()`` steps only the shard; a step post-hook then all-gathers the new
  parameters (stages 1-2) or just refreshes the compute shard (stage 3, gathered lazily);
* stage 3's gathering and prefetch: :mod:`llmlab.parallel.data.zero_stage3`;
* clipping: :meth:`clip_grad_norm_` by the norm of :func:`llmlab.parallel.norm.global_grad_norm`
  over the shards (summed over the data group), the one norm every strategy uses;
* mixed precision: give the engine a model already cast to bf16/fp16 (and the fp32 values it had,
  ``initial``); at stages 1-3 it keeps the fp32 master *shards* itself, so the precision plugin
  keeps only the loss scale (:class:`~llmlab.parallel.data.zero_precision.ZeroMasterWeights`);
* checkpoints: the pieces by name, gathered or loaded, in
  :mod:`llmlab.parallel.checkpoint.zero_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.buffers import FlatBuffer
from llmlab.parallel.data.zero_layout import (
    Piece,
    Unit,
    all_gather_into,
    build_unit,
    partition,
    reduce_scatter_into,
)
from llmlab.parallel.data.zero_memory import ZeroMemory
from llmlab.parallel.data.zero_stage3 import Stage3Gatherer
from llmlab.parallel.norm import clip_by_total_norm_, global_grad_norm

STAGES = (0, 1, 2, 3)


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
        kept: parameters the optimizer also steps that this engine leaves whole and alone (an
            expert-parallel rank's expert slices: replicated over other ranks than the data
            group, their gradients reduced by the caller); :meth:`rewire` keeps them as they
            are.
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
        kept: Sequence[nn.Parameter] = (),
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs torch.distributed initialised (any backend)")
        self.module = module
        self.stage = stage
        self.kept = list(kept)
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
        self._full_grads: set[int] = set()  # stages 2-3: parameters holding a full gradient
        self.memory = ZeroMemory(self.units, stage, self.kept)
        self._optimizers = self.memory.optimizers
        self._members: dict[int, list[list[nn.Parameter]]] = {}  # param groups before rewire
        self._comm_bytes = 0  # payload of the collectives run since take_comm_bytes
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for u in self.units
            for p in u.params
            if reduce_in_backward
        ]
        self.stage3: Stage3Gatherer | None = None
        if stage >= 3:
            if not reduce_in_backward:
                raise ValueError(
                    "ZeRO-3 gathers and frees parameters around each backward pass, so it must "
                    "reduce in backward too (reduce_in_backward=True)"
                )
            self.stage3 = Stage3Gatherer(
                module, blocks, self.units, self.group, self.world, prefetch,
                track=self.memory.track, begin_backward=self._begin_backward,
                in_backward=lambda: self._in_backward,
            )  # fmt: skip

    @classmethod
    def for_held(
        cls,
        model: nn.Module,
        stage: int,
        group: dist.ProcessGroup | None,
        held: Sequence[nn.Parameter],
        **options: Any,
    ) -> ZeroEngine:
        """ZeRO for the parameters ``held`` by this rank of a split model (a tensor-parallel
        shard, a pipeline stage), named as in the unsplit model; its units are the repeated
        blocks this rank holds. ``options``: the constructor's keywords."""
        ids = {id(p) for p in held}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in ids]
        get_blocks = getattr(model, "repeated_blocks", None)
        blocks = [
            b
            for b in (get_blocks() if callable(get_blocks) else [])
            if any(id(p) in ids for p in b.parameters())
        ]
        return cls(model, stage, group, blocks=blocks, named_params=named, **options)

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
            kept = {id(p) for p in self.kept}
            for gi, group in enumerate(optimizer.param_groups):
                new = []
                for p in group["params"]:
                    if id(p) in kept:
                        new.append(p)
                        continue
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
        optimizer.register_step_post_hook(lambda *_: self.memory.measure_optimizer())
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
            if self.stage3 is not None:
                if u.gathered:
                    self.stage3.free(u)  # stale: gathered again when next used
            elif self.world > 1:
                self._comm_bytes += u.full.nbytes
                works.append(all_gather_into(u.full.data, u.shard, group=self.group, async_op=True))
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
            self.memory.track(p.grad.numel() * p.grad.element_size())
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
                            self.memory.track(-p.grad.numel() * p.grad.element_size())
                        p.grad = None
                flat = tmp.data.div_(n)
                self.memory.track(tmp.nbytes)
                keep.append(flat)
            out = (
                u.grad_shard if flat.dtype == u.grad_shard.dtype else flat.new_empty(u.shard_numel)
            )
            keep.append(out)
            if n > 1:
                work = reduce_scatter_into(out, flat, group=self.group, async_op=True)
            else:
                out.copy_(flat)
                work = None
        if n > 1:
            self._comm_bytes += flat.numel() * flat.element_size()
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
            self.memory.track(-keep[0].numel() * keep[0].element_size())
        for pc in u.pieces:
            pc.master.grad = u.grad_shard[pc.at : pc.at + pc.hi - pc.lo]

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
        if self.stage3 is not None:
            self.stage3.end_backward()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """All full parameters present (ZeRO-3), e.g. to evaluate or export; freed after."""
        if self.stage3 is None:
            yield
            return
        with self.stage3.gathered():
            yield

    # ================================================================ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the sharded gradients; returns the norm (of
        every parameter the engine manages: the shards summed over the data group)."""
        grads = self.optimizer_grads()
        sharded = self.stage >= 1 and self.world > 1
        total = global_grad_norm(
            grads, [1.0] * len(grads), [self.group] if sharded else [], norm_type
        )
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

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, model parameter)`` for every parameter this engine manages."""
        return [(n, p) for u in self.units for n, p in zip(u.names, u.params)]

    def all_pieces(self) -> list[Piece]:
        """Every piece this rank holds (stages 1-3), unit by unit."""
        return [pc for u in self.units for pc in u.pieces]

    def model_param_of(self) -> dict[int, nn.Parameter]:
        """``id(optimizer tensor) -> model parameter`` (the pieces, at stages 1-3)."""
        return {id(pc.master): pc.param for u in self.units for pc in u.pieces}

    # ================================================================ accounting
    def take_comm_bytes(self) -> int:
        """Payload bytes of the collectives run since the last call (a strategy logs them)."""
        sent = self._comm_bytes + (self.stage3.comm_bytes if self.stage3 is not None else 0)
        self._comm_bytes = 0
        if self.stage3 is not None:
            self.stage3.comm_bytes = 0
        return sent

    def memory_stats(self) -> dict[str, float]:
        """Per-rank model-state bytes, ``memory/*_bytes`` (:mod:`.zero_memory`)."""
        return self.memory.stats()

    def close(self) -> None:
        """Remove every hook and leave the module a plain one: at stage 3 every unit is gathered
        first, so the module holds all its parameters again."""
        if self.stage3 is not None:
            self.stage3.close()
        for h in self._handles:
            h.remove()
        self._handles = []
