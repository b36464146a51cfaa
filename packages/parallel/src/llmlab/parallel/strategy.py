"""``NDParallelStrategy``: data × pipeline × context × tensor parallelism on one mesh, one
Lightning strategy (``"nd"``; ``strategy=pipeline`` and ``=tensor`` are presets: ``presets``).

Lightning's hooks, each calling the mechanism that does the work:

* layout: one :class:`~llmlab.parallel.mesh.ParallelDims`, judged by
  :func:`~llmlab.parallel.mesh.check_layout` when built, when the Trainer knows the world (before
  any launch) and, with the model and batch, in ``setup`` (``check_config``: the same, for the
  app, before any process starts);
* ``setup``: process groups, :func:`~llmlab.parallel.parallelize.parallelize_model`, the
  pipeline's :class:`~llmlab.parallel.pipeline.step.PipelinedStep`, ZeRO's
  :class:`~llmlab.parallel.data.zero.ZeroEngine` on the data group (its fp32 shards become the
  precision plugin's masters, ``plugin.use_masters``), the whole-model norm the plugin clips by
  (``plugin.clip_by_norm_of``), the checkpoint door (``checkpointer.LayoutCheckpointer``);
* steps: the task's own forward and backward, or a schedule inside ``training_step`` whose
  gradients ``backward`` hands back; a context-parallel model runs split only inside steps
  (:mod:`llmlab.parallel.context.step`); once per optimizer step, tied weights summed over their
  stages and gradients averaged over the data (× context) group
  (:class:`~llmlab.parallel.pipeline.grad_sync.GradientReducer`), or ZeRO's reduce-scatter;
  ``comm/*`` bytes (:mod:`llmlab.parallel.step_comm`) and, under ZeRO, ``memory/*_bytes``;
* checkpoints of the unsplit model by name, consolidated or (``sharded_checkpoints=True``) one
  DCP folder of every rank's shards: any layout's resumes in any other and loads into a plain
  model; they are restored after ``setup``, when every tensor is in its final place.

With a pipeline only ``zero=1`` is accepted (``nd_options.ZERO_WITH_PIPELINE``). ``expert``: the
ranks of data × context each MoE layer's experts are split over (:mod:`llmlab.parallel.expert`;
what it does not compose with yet: ``expert.EXPERT_REFUSALS``).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.checkpoint.checkpointer import LayoutCheckpointer
from llmlab.parallel.checkpoint.pretrained import take_pretrained_weights
from llmlab.parallel.compile import compile_refusal
from llmlab.parallel.context.group import ContextParallel
from llmlab.parallel.context.step import split_batch
from llmlab.parallel.data.fsdp2 import FSDP2Engine
from llmlab.parallel.data.sharding import build_data_sharding
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.data.zero_memory import ReplicatedMemory
from llmlab.parallel.data.zero_precision import ZeroMasterWeights
from llmlab.parallel.loss_mean import LossReplicas
from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from llmlab.parallel.nd_mechanisms import build_step_mechanisms
from llmlab.parallel.nd_options import check_options, check_run
from llmlab.parallel.norm import WholeModelNorm
from llmlab.parallel.parallelize import ParallelModel, parallelize_model
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.split_layout import check_split_backward
from llmlab.parallel.pipeline.stage import move_held_tensors
from llmlab.parallel.pipeline.step import PipelinedStep
from llmlab.parallel.precision.plugins import (
    MasterWeightPrecision,
    WholeModelClipping,
    with_whole_model_clipping,
)
from llmlab.parallel.preflight import RunConfig
from llmlab.parallel.step_comm import StepComm
from llmlab.parallel.transforms import ModelTransforms

log = logging.getLogger(__name__)


class NDParallelStrategy(DDPStrategy):
    """Data × pipeline × context × tensor parallelism of ``lightning_module.<model_attribute>``.

    The layout arguments make one :class:`~llmlab.parallel.mesh.ParallelDims` (``context``:
    ranks per sequence, zigzag ring attention). ``data``: optional, inferred as
    ``world_size / (pipeline × context × tensor)`` and checked if given. ``schedule``: "naive",
    "gpipe", "1f1b", "interleaved" (``virtual_stages`` chunks per rank, default 2) or the
    split-backward "zb1", "zbv", "dualpipev" (V-shaped: 2 chunks per rank); ``boundaries``: the
    first layer index of every virtual stage after the first (default: balanced by parameter
    count). ``transforms``: memory options and compile (``ModelTransforms`` or its mapping), as
    ``parallelize_model`` applies them. ``timeline_every_n_steps``: how often a pipeline records
    its timeline, logs ``pipeline/bubble`` and (rank 0) draws the Gantt chart (0: off).
    ``zero``: ZeRO stage of the data (× context) dimension, by ``zero_impl`` "llmlab" or "fsdp2"
    (:mod:`~llmlab.parallel.data.sharding`). ``sharded_checkpoints``: each rank writes its own
    shards (a DCP folder) instead of gathering the model on rank 0.
    """

    strategy_name = "nd"
    compile_checked = True  # compile=true matched eager training, in every layout

    def __init__(
        self,
        data: int | None = None,
        pipeline: int = 1,
        tensor: int = 1,
        context: int = 1,
        sequence_parallel: bool = False,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        boundaries: Sequence[int] | None = None,
        transforms: ModelTransforms | Mapping[str, Any] | None = None,
        model_attribute: str = "model",
        timeline_every_n_steps: int = 50,
        timeline_dir: str | None = None,
        zero: int = 0,
        sharded_checkpoints: bool = False,
        zero_impl: str = "llmlab",
        expert: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.requested = ParallelDims(
            data,
            pipeline,
            context,
            tensor,
            sequence_parallel=sequence_parallel,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            boundaries=None if boundaries is None else tuple(boundaries),
            expert=expert,
        )  # the layout as asked; ``dims`` is it on this world
        self._dims: ParallelDims | None = None
        self.transforms = ModelTransforms.from_config(transforms)
        check_options(self.requested, zero, zero_impl, self.transforms)
        self.zero, self.zero_impl = zero, zero_impl
        self.sharded_checkpoints = bool(sharded_checkpoints)
        self.model_attribute = model_attribute
        self.timeline_every_n_steps = timeline_every_n_steps
        self.timeline_dir = timeline_dir
        self._groups: ProcessGroups | None = None
        self.parallel: ParallelModel | None = None
        self.pipeline_step: PipelinedStep | None = None
        self.context: ContextParallel | None = None
        self.zero_engine: ZeroEngine | FSDP2Engine | None = None
        self.checkpointer: LayoutCheckpointer | None = None
        self.comm = StepComm()
        self.last_comm: dict[str, float] = {}
        self._reducer: GradientReducer | None = None
        self._memory: ReplicatedMemory | ZeroEngine | FSDP2Engine | None = None  # memory/*
        self._norm: WholeModelNorm | None = None
        self._sync_grads = True
        self._weights: Any = None  # a meta model's pretrained weights, read in setup

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """Every check of the constructor, then the layout against the run's world, batch and
        model (built on the ``meta`` device only when tensor or pipeline > 1)."""
        if run.transforms.compile and not cls.compile_checked:
            raise ValueError(compile_refusal(cls.__name__))
        s = cls(**options, transforms=run.transforms)
        check_run(s.requested, s.zero, s.zero_impl, run)

    # ------------------------------------------------------------------- layout
    @property
    def dims(self) -> ParallelDims:
        """The layout on this world (``requested`` with ``data`` filled in); fails with
        :func:`~llmlab.parallel.mesh.check_layout`'s message when the numbers do not fit."""
        if self._dims is None or self._dims.world_size != self.world_size:
            self._dims = self.requested.resolve(self.world_size)
        return self._dims

    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:
            raise RuntimeError(f"{type(self).__name__}.setup has not run yet")
        return self._groups

    @property
    def loss_replicas(self) -> LossReplicas:
        """The data × context ranks, each with different tokens of the global batch, whose
        gradients are averaged (:mod:`llmlab.parallel.loss_mean`); under SP, the row shards."""
        shards = self.groups.tensor if self.dims.sequence_parallel else None
        return LossReplicas(self.groups.replica, self.dims.replicas, shards)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas only: every pipeline stage and tensor rank of one replica
        reads the same batch."""
        dims = self.dims
        return {"num_replicas": dims.data, "rank": dims.coords(self.global_rank).data}

    @property
    def local_param_count(self) -> int:
        """Parameters this rank holds (a tied weight once)."""
        return self.parallel.held_parameter_count if self.parallel is not None else 0

    def set_world_ranks(self) -> None:
        """Lightning calls this when the Trainer is built: a layout that cannot fit this world
        is refused there, before any process is launched."""
        super().set_world_ranks()
        _ = self.dims

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = with_whole_model_clipping(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's own fp32 / autocast plugins become the subclasses that clip by the norm
        this strategy gives them (:func:`with_whole_model_clipping`)."""
        self._precision_plugin = None if plugin is None else with_whole_model_clipping(plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint is read where every tensor lives: after setup

    # -------------------------------------------------------------------- setup
    def connect(self, model: pl.LightningModule) -> None:
        """Pretrained weights a module holds for its meta model are read in ``setup``, each rank
        its part (taken here, before Lightning's ``configure_model`` could read them whole)."""
        super().connect(model)
        self._weights = take_pretrained_weights(model) or self._weights

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module, dims = self.lightning_module, self.dims
        check_split_backward(dims.schedule, False, getattr(self.precision_plugin, "options", None))
        model = getattr(module, self.model_attribute, None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(module).__name__} has no module attribute {self.model_attribute!r}; "
                f"{type(self).__name__} parallelizes lightning_module.<model_attribute>"
            )
        self._groups = build_process_groups(dims)
        self.model_to_device()
        self.parallel = parallel = parallelize_model(
            model,
            dims,
            self._groups,
            self.transforms,
            convert_precision=self.precision_plugin.convert_module,
            seed=torch.initial_seed(),
            global_batch=getattr(getattr(trainer, "datamodule", None), "batch_size", None),
            weights=self._weights,
        )
        self._weights = None
        module.loss_fn, self.context = parallel.task_loss(module.loss_fn), parallel.context
        self.model_to_device()
        if parallel.stage is not None:
            scale = getattr(self.precision_plugin, "scale_loss", None)
            self.pipeline_step = PipelinedStep.build(
                parallel,
                self.groups,
                lambda out, target: module.loss_fn(out, target),
                self.root_device,
                scale if callable(scale) else None,
                self.timeline_every_n_steps,
                self.timeline_dir,
            )
        plugin = self.precision_plugin
        fp32 = plugin.fp32_values() if isinstance(plugin, MasterWeightPrecision) else None
        if self.zero >= 1 and self.zero_engine is None:
            self.zero_engine = build_data_sharding(
                self.zero_impl,
                model,
                self.zero,
                self.groups,
                parallel.params,
                self.precision_plugin,
                self.root_device.type,
                fp32,
                # a pipeline sums tied weights across stages first: it reduces once per step
                reduce_in_backward=self.pipeline_step is None,
            )
            self.comm = StepComm(getattr(self.zero_engine, "counting", None))
        where = f"rank {self.global_rank} at {self.groups.coords}"
        log.info("nd layout %s: %s holds %d parameters", dims, where, self.local_param_count)
        log.info("applied %s", parallel.applied)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            engine_held = self.zero_engine.named_params() if self.zero_engine else ()
            held = {id(p) for p in parallel.params} | {id(p) for _, p in engine_held}
            for optimizer in self.optimizers:  # other stages' placeholders are not ours
                for group in optimizer.param_groups:
                    group["params"] = [p for p in group["params"] if id(p) in held]
                if self.zero_engine is not None:
                    self.zero_engine.rewire(optimizer)
        if isinstance(self.zero_engine, ZeroEngine) and isinstance(plugin, MasterWeightPrecision):
            plugin.use_masters(  # the engine's fp32 shards are the masters
                ZeroMasterWeights(self.zero_engine, plugin.scaler, plugin.skip_nonfinite)
            )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._connect_mechanisms(trainer)

    def _connect_mechanisms(self, trainer: pl.Trainer) -> None:
        """The reducer, the whole-model norm (the plugin clips by it) and the checkpoint door
        (:mod:`llmlab.parallel.nd_mechanisms`)."""
        built = build_step_mechanisms(self)
        self._reducer, self._memory, self._norm = built.reducer, built.memory, built.norm
        self.checkpointer = built.checkpointer
        plugin = self.precision_plugin
        if isinstance(plugin, WholeModelClipping):
            plugin.clip_by_norm_of(self.global_grad_norm)
        elif trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            raise ValueError(
                f"{type(self).__name__} clips by the whole model's norm, which precision plugin "
                f"{type(plugin).__name__} cannot take; use precision 32-true, bf16-mixed, "
                "bf16-true or an llmlab precision plugin"
            )

    def configure_ddp(self) -> None:  # no DDP wrapper: gradients are reduced in ``backward``
        pass

    def model_to_device(self) -> None:
        assert self.model is not None
        move_held_tensors(self.model, self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown, except that the module goes back to the CPU tensor by tensor
        (``module.cpu()`` cannot copy the other stages' ``meta`` placeholders)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        if self.zero_engine is not None:  # full parameters back in the module, hooks removed;
            self.zero_engine.close()  # the shards stay: a checkpoint after fit reads them
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            move_held_tensors(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---------------------------------------------------------------- training
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batches: accumulate locally, reduce nothing."""
        self._sync_grads = False
        engine = self.zero_engine if self.pipeline_step is None else None
        try:
            with engine.no_sync() if engine is not None else nullcontext():
                yield
        finally:
            self._sync_grads = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.comm.recording(), split_batch(self.context, args) as args:
            if self.pipeline_step is None:
                return super().training_step(*args, **kwargs)
            batch = args[0] if args else kwargs["batch"]
            plugin = self.precision_plugin
            return self.pipeline_step.train_step(
                self.lightning_module, batch, plugin.train_step_context
            )

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        module = self.lightning_module
        with self.comm.recording(), split_batch(self.context):  # checkpointing re-runs forwards
            if self.pipeline_step is None:
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            else:  # no autograd here: restore what the schedule computed in training_step
                self.pre_backward(closure_loss)
                closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
                self.pipeline_step.restore_grads(
                    max(1, int(module.trainer.accumulate_grad_batches))
                )
                closure_loss = self.precision_plugin.post_backward(closure_loss, module)
                self.post_backward(closure_loss)
        if self._sync_grads:
            self.reduce_gradients()
        return closure_loss

    def reduce_gradients(self) -> None:
        """Once per optimizer step: tied copies summed over their stages, then every gradient
        averaged over the data group (ZeRO: reduce-scattered, during backward without a
        pipeline)."""
        assert self._reducer is not None
        if self.zero_engine is not None and self.pipeline_step is None:
            if isinstance(self.zero_engine, FSDP2Engine):  # partial sums, expert division
                self.zero_engine.finish_gradients()
            self._reducer.reduce_experts()  # expert slices are not the engine's
            return  # ZeRO reduce-scattered during backward (its end-of-backward callback)
        self._reducer()
        if self.zero_engine is not None:
            self.zero_engine.reduce_gradients()

    def optimizer_step(
        self, optimizer: Optimizer, closure: Any, model: Any = None, **kw: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kw)
        self._log_comm()
        return out

    def _log_comm(self) -> None:
        assert self._reducer is not None and self._memory is not None
        self.comm.take_step(self._reducer, self)
        self.last_comm = {**self.comm.metrics(), **self._memory.memory_stats()}
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(self.last_comm, step=trainer.global_step)

    def global_grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The whole model's gradient norm, identical on every rank (a collective): what
        ``train/grad_norm`` logs and what the precision plugin clips by."""
        assert self._norm is not None
        return self._norm(self.precision_plugin.main_params(optimizer))

    @property
    def last_bubble(self) -> float | None:
        return self.pipeline_step.last_bubble if self.pipeline_step is not None else None

    # -------------------------------------------------------------- validation
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluating(), split_batch(self.context, args, count=False) as args:
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluating(), split_batch(self.context, args, count=False) as args:
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluating():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _evaluating(self) -> Generator[None, None, None]:
        """Outside training steps: the pipeline's whole-model stand-in, and expert all-to-alls
        that are no training step's ``comm/ep_bytes``."""
        expert = self.parallel.expert if self.parallel is not None else None
        with self._model_replaced(), expert.uncounted() if expert else nullcontext():
            yield

    def _model_replaced(self) -> Any:
        if self.pipeline_step is None:
            return nullcontext()
        return self.pipeline_step.replaced_model(self.lightning_module, self.model_attribute)

    # -------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit model's state dict, full tensors (a collective); sharded: the rest."""
        return self._checkpoints().model_state()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints().load_model_state(checkpoint, self.optimizers, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpoints().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            self._checkpoints().load_optimizer_state(optimizer, saved)
            _optimizers_to_device([optimizer], self.root_device)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Consolidated: rank 0 writes the file. Sharded: every rank writes its shards into the
        folder ``filepath`` (atomically), rank 0 also Lightning's small state. Either way the
        precision plugin's fp32 masters are saved by name, fp8 amax histories per tensor rank."""
        checkpointer = self._checkpoints()
        checkpointer.prepare_save(checkpoint, type(self.precision_plugin).__qualname__)
        if not checkpointer.sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ValueError("sharded checkpoints take no storage_options (they write with DCP)")
        checkpointer.save(checkpoint, filepath, self.optimizers)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """A sharded checkpoint (a DCP folder) from any layout, or a consolidated file. Of a
        sharded one only Lightning's small state is read here; the tensors follow in
        ``load_model_state_dict``."""
        checkpointer = self._checkpoints()
        checkpoint = checkpointer.read(checkpoint_path)
        if checkpoint is None:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpointer.prepare_load(checkpoint, type(self.precision_plugin).__qualname__)
        return checkpoint

    def _checkpoints(self) -> LayoutCheckpointer:
        if self.checkpointer is None:
            raise RuntimeError(
                f"{type(self).__name__}: checkpoints are read and written after setup"
            )
        return self.checkpointer

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab data × pipeline × context × tensor"
        )


if "nd" not in StrategyRegistry:
    NDParallelStrategy.register_strategies(StrategyRegistry)
