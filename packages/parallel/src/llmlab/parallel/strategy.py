"""``NDParallelStrategy``: data × pipeline × tensor parallelism on one mesh, as one Lightning
strategy (registered as ``"nd"``; ``strategy=pipeline`` and ``strategy=tensor`` are presets).

Layout: ``world_size = data × pipeline × tensor`` (``llmlab.parallel.mesh``: tensor innermost,
then pipeline, then data), checked before the process group starts. In ``setup`` the strategy
builds the process groups and hands the task's plain model to
:func:`~llmlab.parallel.parallelize.parallelize_model`, which shards it (tensor, sequence),
applies the memory transforms, keeps this rank's pipeline stage and converts its precision. Then,
every optimizer step:

* **forward and backward.** With ``pipeline == 1`` they are the task's own (Lightning's
  ``training_step`` and backward on the sharded model). With ``pipeline > 1`` the strategy owns
  the step: a schedule (naive, gpipe, 1f1b, interleaved) runs the micro-batches through the
  stages; the gradients it computes are kept aside and handed back in ``backward`` (Lightning
  zeroes gradients between the two), scaled by the precision plugin's loss scale.
* **gradient reduction**, once per optimizer step (not on accumulation micro-batches): tied
  weights summed over the stages that hold a copy, then every gradient averaged over the data
  group with one flat all-reduce. Sequence-parallel parameters are reduced over the tensor group
  by their own hooks during backward.
* **ZeRO** (``zero=1|2|3``, :class:`~llmlab.parallel.data.zero.ZeroEngine` on the data group):
  the optimizer steps this rank's shard of each unit (a repeated block, or the rest), gradients
  are reduce-scattered (during backward without a pipeline; after the schedule and the tied-weight
  sum with one), stage 2 frees full gradients, stage 3 full parameters. With a pipeline only
  ``zero=1`` is accepted (see ``ZERO_WITH_PIPELINE``). ``memory/*_bytes`` are logged each step.
* **clipping** by the norm of the whole model (:mod:`llmlab.parallel.norm`): shards summed over
  the tensor group, stages over the pipeline group, each parameter counted once; the same norm is
  what ``train/grad_norm`` logs (``global_grad_norm``).
* **accounting**: ``comm/tp_bytes`` (every tensor-parallel collective's payload), ``comm/pp_bytes``
  (activations and gradients sent to other stages, plus the tied-weight all-reduce) and
  ``comm/dp_bytes`` (the gradient all-reduce), per optimizer step and rank; ``pipeline/bubble``
  from a recorded timeline every ``timeline_every_n_steps``.
* **checkpoints** hold the unsplit model's tensors by name, so a checkpoint from any layout
  resumes in any other (another data, pipeline or tensor degree, another ZeRO stage) and loads
  into a plain model. By default they are consolidated (:mod:`llmlab.parallel.consolidate`):
  gathered into one file on rank 0. With ``sharded_checkpoints=True`` every rank writes only
  what it holds into a ``torch.distributed.checkpoint`` folder
  (:mod:`llmlab.parallel.checkpoint.layout_state`): no rank ever holds the whole model, which is
  the point of sharding it. Loading reads either kind, whatever layout wrote it;
  ``python -m llmlab.parallel.checkpoint consolidate DIR OUT.pt`` makes a plain ``state_dict``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel import consolidate
from llmlab.parallel.buffers import all_reduce_mean_
from llmlab.parallel.checkpoint import is_sharded, read_extra
from llmlab.parallel.checkpoint.layout_state import LayoutState
from llmlab.parallel.compile import COMPILE_WITH_TENSOR, compile_refusal
from llmlab.parallel.data.zero import STAGES as ZERO_STAGES
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.data.zero_precision import ZeroMasterWeights
from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups, check_layout
from llmlab.parallel.norm import WholeModelNorm
from llmlab.parallel.parallelize import ModelTransforms, ParallelModel, parallelize_model
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.stage import move_held_tensors
from llmlab.parallel.pipeline.timeline import gather_events, measured_bubble, plot_timeline
from llmlab.parallel.pipeline.transport import broadcast_tensor
from llmlab.parallel.precision.plugins import (
    MasterWeightPrecision,
    WholeModelClipping,
    WholeModelPrecision,
    with_whole_model_clipping,
)
from llmlab.parallel.preflight import RunConfig
from llmlab.parallel.tensor.accounting import CommLedger, record_into

log = logging.getLogger(__name__)

SHARDED_KEY = "llmlab_sharded_checkpoint"  # a loaded checkpoint's marker: its DCP folder

ZERO_WITH_PIPELINE = (
    "a pipeline runs several micro-batch backward passes per step, so ZeRO-2 would either keep "
    "every full gradient until the step (no saving) or reduce-scatter after every micro-batch "
    "(microbatches x the data traffic), and ZeRO-3 would gather each block's parameters twice "
    "per micro-batch while the schedule interleaves the micro-batches' forwards and backwards. "
    "DeepSpeed refuses ZeRO-2/3 with its pipeline engine for the same reason; use zero=1 with "
    "pipeline > 1 (or ZeRO-2/3 with data x tensor)"
)


class _PipelinedForward(nn.Module):
    """Stands in for ``module.model`` during validation: ``forward(x)`` runs the forward-only
    schedule and returns the last stage's output on every rank of the pipeline."""

    def __init__(self, run: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self._run = run

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)


class NDParallelStrategy(DDPStrategy):
    """Data × pipeline × tensor parallelism of ``lightning_module.<model_attribute>``.

    ``data``: optional, inferred as ``world_size / (pipeline × tensor)`` and checked if given.
    The layout options (``data`` ... ``boundaries``, ``context``) make one
    :class:`~llmlab.parallel.mesh.ParallelDims`, checked at once.
    ``pipeline``, ``schedule`` ("naive", "gpipe", "1f1b", "interleaved"), ``microbatches``,
    ``virtual_stages`` (interleaved: chunks per rank, default 2), ``boundaries`` (first layer
    index of every virtual stage after the first; default: balanced by parameter count).
    ``tensor``, ``sequence_parallel``. ``transforms``: memory options (``ModelTransforms`` or
    its config mapping). ``timeline_every_n_steps``: how often a pipeline records its timeline,
    logs ``pipeline/bubble`` and (rank 0) draws the Gantt chart; 0 turns it off.
    ``zero``: ZeRO stage of the data dimension. ``sharded_checkpoints``: each rank writes its own
    shards (a DCP folder) instead of gathering the model on rank 0.
    """

    strategy_name = "nd"

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
        )  # the layout as asked; ``dims`` is it on this world
        self._dims: ParallelDims | None = None
        if zero not in ZERO_STAGES:
            raise ValueError(f"strategy.zero must be one of {ZERO_STAGES}, got {zero!r}")
        if zero >= 2 and pipeline > 1:
            raise ValueError(
                f"strategy.zero={zero} with strategy.pipeline={pipeline} is refused: "
                f"{ZERO_WITH_PIPELINE}"
            )
        self.transforms = ModelTransforms.from_config(transforms)
        if self.transforms.compile and tensor > 1:
            raise ValueError(COMPILE_WITH_TENSOR)
        self.model_attribute = model_attribute
        self.timeline_every_n_steps = timeline_every_n_steps
        self.timeline_dir = timeline_dir
        self._groups: ProcessGroups | None = None
        self.parallel: ParallelModel | None = None
        self._engine: PipelineEngine | None = None
        self._kept_grads: list[tuple[nn.Parameter, Tensor]] = []
        self._sync_grads = True
        self._ledger = CommLedger()
        self._dp_bytes = 0
        self._pp_bytes = 0  # tied-weight all-reduce; the transport counts activations/gradients
        self.last_comm: dict[str, float] = {}
        self.last_bubble: float | None = None
        self.zero = zero
        self.zero_engine: ZeroEngine | None = None
        self.sharded_checkpoints = bool(sharded_checkpoints)

    # ---------------------------------------------------------------- config check
    compile_checked = True  # compile=true matched eager training (tensor > 1 is refused anyway)

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """Every check of the constructor, then the layout against the run's world, batch and
        model (built on the ``meta`` device only when tensor or pipeline > 1)."""
        if run.transforms.compile and not cls.compile_checked:
            raise ValueError(compile_refusal(cls.__name__))
        dims = cls(**options, transforms=run.transforms).requested
        model = run.model() if dims.tensor > 1 or dims.pipeline > 1 else None
        check_layout(dims, world_size=run.world_size, model=model, global_batch=run.global_batch)

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
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas only: every pipeline stage and tensor rank of one replica
        reads the same batch."""
        dims = self.dims
        return {"num_replicas": dims.data, "rank": dims.coords(self.global_rank).data}

    @property
    def stage_index(self) -> int:
        return self.dims.coords(self.global_rank).pipeline

    @property
    def local_param_count(self) -> int:
        """Parameters this rank holds (a tied weight once)."""
        return self.parallel.held_parameter_count if self.parallel is not None else 0

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = WholeModelPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's own fp32 / autocast plugins become the subclasses that clip by the norm
        this strategy gives them (``with_whole_model_clipping``)."""
        self._precision_plugin = None if plugin is None else with_whole_model_clipping(plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A checkpoint is read where every tensor lives: after ``setup``."""
        return True

    def set_world_ranks(self) -> None:
        """Lightning calls this when the Trainer is built: a layout that cannot fit this world
        is refused there, before any process is launched."""
        super().set_world_ranks()
        _ = self.dims

    # -------------------------------------------------------------------- setup
    def _target_model(self) -> nn.Module:
        module = self.lightning_module
        model = getattr(module, self.model_attribute, None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(module).__name__} has no module attribute {self.model_attribute!r}; "
                f"{type(self).__name__} parallelizes lightning_module.<model_attribute>"
            )
        return model

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        dims = self.dims
        model = self._target_model()
        self._groups = build_process_groups(dims)
        self.model_to_device()
        self.parallel = parallelize_model(
            model,
            dims,
            self._groups,
            self.transforms,
            convert_precision=self.precision_plugin.convert_module,
            seed=torch.initial_seed(),
            global_batch=getattr(getattr(trainer, "datamodule", None), "batch_size", None),
        )
        module = self.lightning_module
        if self.parallel.loss_fn is not None or self.transforms.compile:
            module.loss_fn = self.parallel.task_loss(module.loss_fn)
        self.model_to_device()
        if self.parallel.stage is not None:
            self._engine = self._build_engine()
        if self.zero >= 1 and self.zero_engine is None:
            self.zero_engine = self._build_zero_engine(model)
        log.info(
            "nd layout %s: rank %d at %s holds %d parameters; applied %s",
            dims, self.global_rank, self._groups.coords, self.local_param_count,
            self.parallel.applied,
        )  # fmt: skip
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            held = {id(p) for p in self.parallel.params}
            for optimizer in self.optimizers:  # other stages' placeholders are not ours
                for group in optimizer.param_groups:
                    group["params"] = [p for p in group["params"] if id(p) in held]
                if self.zero_engine is not None:
                    self.zero_engine.rewire(optimizer)
        plugin = self.precision_plugin
        if self.zero_engine is not None and isinstance(plugin, MasterWeightPrecision):
            plugin.use_masters(  # the engine's fp32 shards are the masters
                ZeroMasterWeights(self.zero_engine, plugin.scaler, plugin.skip_nonfinite)
            )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if isinstance(plugin, WholeModelClipping):
            plugin.clip_by_norm_of(self.global_grad_norm)
        elif trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            raise ValueError(
                f"{type(self).__name__} clips by the whole model's norm, which precision plugin "
                f"{type(plugin).__name__} cannot take; use precision 32-true, bf16-mixed, "
                "bf16-true or an llmlab precision plugin"
            )

    def _build_engine(self) -> PipelineEngine:
        assert self.parallel is not None and self.parallel.stage is not None
        dims, coords = self.dims, self.groups.coords
        module = self.lightning_module
        plugin = self.precision_plugin
        scale = getattr(plugin, "scale_loss", None)
        return PipelineEngine(
            self.parallel.stage.chunks,
            coords.pipeline,
            dims.pipeline,
            ranks=dims.pipeline_ranks(coords),
            loss_fn=lambda out, target: module.loss_fn(out, target),
            group=self.groups.pipeline,
            device=self.root_device,
            scale_loss=scale if callable(scale) else None,
        )

    def _build_zero_engine(self, model: nn.Module) -> ZeroEngine:
        """ZeRO over the data group, for the parameters this rank holds (a tensor-parallel shard,
        a pipeline stage), named as in the unsplit model; its units are the repeated blocks this
        rank holds. fp32 masters start from the values the precision plugin kept, if any."""
        assert self.parallel is not None
        plugin = self.precision_plugin
        held = {id(p) for p in self.parallel.params}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in held]
        get_blocks = getattr(model, "repeated_blocks", None)
        blocks = [
            b
            for b in (get_blocks() if callable(get_blocks) else [])
            if any(id(p) in held for p in b.parameters())
        ]
        engine = ZeroEngine(
            model,
            self.zero,
            self.groups.data,
            blocks=blocks,
            named_params=named,
            initial=plugin.fp32_values() if isinstance(plugin, MasterWeightPrecision) else None,
            # a pipeline runs a backward per micro-batch and the strategy sums tied weights
            # across stages first: it reduces once per step itself (reduce_gradients)
            reduce_in_backward=self._engine is None,
        )
        return engine

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
        engine = self.zero_engine if self._engine is None else None
        if engine is not None:
            engine.sync = False
        try:
            yield
        finally:
            self._sync_grads = True
            if engine is not None:
                engine.sync = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with record_into(self._ledger):
            if self._engine is None:
                return super().training_step(*args, **kwargs)
            return self._pipelined_training_step(args[0] if args else kwargs["batch"])

    def _pipelined_training_step(self, batch: Any) -> Tensor:
        assert self._engine is not None and self.parallel is not None
        inputs, targets = (
            (batch["input"], batch["target"]) if isinstance(batch, Mapping) else batch[:2]
        )
        step = self.lightning_module.trainer.global_step
        record = self.timeline_every_n_steps > 0 and step % self.timeline_every_n_steps == 0
        self._engine.record_timeline = record
        # The schedule accumulates into .grad; what is there now belongs to Lightning (the
        # previous step's gradients, cleared by the zero_grad that follows this training_step,
        # or earlier batches of an accumulation window), so set it aside and put it back.
        params = self.parallel.params
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            result = self._engine.train_step(
                inputs, targets, self.dims.microbatches, self.dims.schedule
            )
        self._kept_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, previous, strict=True):
            p.grad = grad
        loss = self._pipeline_loss(result.loss)
        self.lightning_module.log("train/loss", loss, prog_bar=True, sync_dist=False)
        if record:
            self._log_timeline(result.events, step)
        return loss

    def _pipeline_loss(self, loss: Tensor | None) -> Tensor:
        """The last stage's loss on every rank, averaged over data-parallel replicas."""
        value = torch.zeros((), device=self.root_device, dtype=torch.float32)
        if loss is not None:
            value += loss.detach().float()
        dims = self.dims
        dist.broadcast(value, self._engine.ranks[-1], group=self.groups.pipeline)  # type: ignore[union-attr]
        if dims.data > 1:
            dist.all_reduce(value, group=self.groups.data)
            value /= dims.data
        return value

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        module = self.lightning_module
        with record_into(self._ledger):
            if self._engine is None:
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            else:  # no autograd here: restore what the schedule computed in training_step
                self.pre_backward(closure_loss)
                closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
                accumulate = max(1, int(module.trainer.accumulate_grad_batches))
                for p, grad in self._kept_grads:
                    grad = grad / accumulate if accumulate > 1 else grad
                    p.grad = grad if p.grad is None else p.grad + grad
                self._kept_grads = []
                closure_loss = self.precision_plugin.post_backward(closure_loss, module)
                self.post_backward(closure_loss)
        if self._sync_grads:
            self.reduce_gradients()
        return closure_loss

    def reduce_gradients(self) -> None:
        """Once per optimizer step: tied copies summed over their stages, then every gradient
        averaged over the data group (one flat all-reduce)."""
        assert self.parallel is not None
        params = self.parallel.params
        zero = self.zero_engine
        if zero is not None and self._engine is None:
            return  # ZeRO reduce-scattered during backward (its end-of-backward callback)
        for p in params:
            if p.grad is None:  # every rank must contribute the same layout
                p.grad = torch.zeros_like(p)
        for p, group in self.parallel.tied:
            dist.all_reduce(p.grad, group=group)
            self._pp_bytes += p.grad.numel() * p.grad.element_size()
        if zero is not None:
            zero.reduce_gradients()
        elif self.dims.data > 1:
            self._dp_bytes += all_reduce_mean_([p.grad for p in params], self.groups.data)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Any, model: Any = None, **kw: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kw)
        self._log_comm()
        return out

    def _log_comm(self) -> None:
        ledger = self._ledger
        pp = self._pp_bytes
        if self._engine is not None:
            pp += self._engine.transport.bytes_sent
            self._engine.transport.bytes_sent = 0
        self.last_comm = {
            "comm/tp_bytes": float(ledger.total_bytes),
            "comm/tp_wire_bytes": float(ledger.total_wire_bytes),
            **{f"comm/tp_{kind}_bytes": float(v) for kind, v in ledger.totals().items()},
            "comm/pp_bytes": float(pp),
            "comm/dp_bytes": float(self._dp_bytes),
        }
        if self.zero_engine is not None:
            self.last_comm["comm/dp_bytes"] += float(self.zero_engine.comm_bytes)
            self.zero_engine.comm_bytes = 0
            self.last_comm.update(self.zero_engine.memory_stats())
        ledger.clear()
        self._dp_bytes = self._pp_bytes = 0
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(self.last_comm, step=trainer.global_step)

    # ----------------------------------------------------------- gradient norm
    def _model_param_of(self) -> dict[int, nn.Parameter]:
        """``id(master) -> model parameter`` for plugins with fp32 master weights (or ZeRO's
        pieces)."""
        if self.zero_engine is not None:
            return self.zero_engine.model_param_of()
        masters = getattr(self.precision_plugin, "masters", None)
        if masters is None:
            return {}
        return {id(m): p for p, m in zip(masters.model_params, masters.masters, strict=True)}

    def _whole_model_norm(self) -> WholeModelNorm:
        """Shards summed over the tensor group, stages over the pipeline group, ZeRO's pieces
        over the data group (see :mod:`llmlab.parallel.norm`)."""
        assert self.parallel is not None
        groups = (self.groups.tensor, self.groups.pipeline)
        if self.zero_engine is not None:
            groups = (*groups, self.groups.data)
        return WholeModelNorm(
            self.dims.tensor, groups, self.parallel.duplicates, self._model_param_of
        )

    def global_grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The whole model's gradient norm, identical on every rank (a collective)."""
        return self._whole_model_norm()(self.precision_plugin.main_params(optimizer))

    # -------------------------------------------------------------- validation
    def _pipelined_forward(self, inputs: Tensor) -> Tensor:
        assert self._engine is not None
        dims = self.dims
        m = dims.microbatches if inputs.shape[0] % dims.microbatches == 0 else 1
        result = self._engine.eval_step(inputs, None, m, dims.schedule)
        output = result.output.float() if result.output is not None else None
        return broadcast_tensor(
            output, self._engine.ranks[-1], self.groups.pipeline, self.root_device
        )

    @contextmanager
    def _model_replaced(self) -> Generator[None, None, None]:
        if self._engine is None:
            yield
            return
        module = self.lightning_module
        real = getattr(module, self.model_attribute)
        setattr(module, self.model_attribute, _PipelinedForward(self._pipelined_forward))
        try:
            yield
        finally:
            setattr(module, self.model_attribute, real)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._model_replaced():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._model_replaced():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._model_replaced():
            return super().predict_step(*args, **kwargs)

    # ---------------------------------------------------------------- timeline
    def _log_timeline(self, events: list, step: int) -> None:
        pipeline = self.dims.pipeline
        merged = gather_events(events, self.groups.pipeline)
        self.last_bubble = measured_bubble(merged, pipeline)
        self.lightning_module.log("pipeline/bubble", self.last_bubble, sync_dist=False)
        if not self.is_global_zero:
            return
        out_dir = Path(self.timeline_dir or self.lightning_module.trainer.default_root_dir)
        path = plot_timeline(
            merged,
            pipeline,
            out_dir / "timelines" / f"pipeline-step{step:06d}.png",
            title=f"{self.dims.schedule} p={pipeline} m={self.dims.microbatches} step {step}",
        )
        logger = self.lightning_module.trainer.logger
        if logger is not None and hasattr(logger, "log_image"):
            try:
                logger.log_image("pipeline/timeline", [str(path)], step=step)
            except Exception as err:  # a disabled or offline logger must not stop training
                log.warning("could not log the pipeline timeline: %s", err)

    # -------------------------------------------------------------- checkpoints
    def _split(self) -> bool:
        return self.parallel is not None

    def _sharded(self) -> bool:
        return self.sharded_checkpoints and self._split()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit model's state dict, full tensors (a collective). With sharded checkpoints
        only what lies outside the model: the model goes to ``save_checkpoint``'s folder."""
        module = self.lightning_module
        if not self._split():
            return module.state_dict()
        if self.sharded_checkpoints:
            prefix = f"{self.model_attribute}."
            return {k: v for k, v in module.state_dict().items() if not k.startswith(prefix)}
        named = consolidate.named_state(module)
        if self.zero_engine is not None:  # the fp32 masters, assembled from the data shards
            full = self.zero_engine.full_params()
            value = {id(p): full[n] for n, p in self.zero_engine.named_params()}
            named = {k: (value.get(id(t), t), dim) for k, (t, dim) in named.items()}
        return consolidate.gather_full(named, self.groups.tensor, self.groups.pipeline)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Full weights sliced to this rank; a sharded checkpoint read where every tensor lives
        (checkpoints are restored after ``setup``)."""
        module = self.lightning_module
        full = checkpoint["state_dict"]
        if SHARDED_KEY in checkpoint:
            module.load_state_dict(full, strict=False)  # what lies outside the model, if any
            self._load_sharded(checkpoint[SHARDED_KEY])
            return
        if not self._split():
            module.load_state_dict(full, strict=strict)
            return
        named = consolidate.named_state(module)
        slices = consolidate.local_slices(full, named, self.groups.tensor, strict=strict)
        zero = self.zero_engine
        if zero is not None:  # each rank copies its pieces into its master shard
            name_of = {id(p): n for n, p in zero.named_params()}
            ours = {k for k in slices if id(named[k][0]) in name_of}
            zero.load_full_params({name_of[id(named[k][0])]: slices[k] for k in ours})
            slices = {k: v for k, v in slices.items() if k not in ours}
        consolidate.load_local_(named, slices)

    def _param_info(self) -> dict[int, tuple[str, int | None]]:
        """``id(optimizer parameter) -> (state-dict name, shard dim)``, masters included."""
        module = self.lightning_module
        info: dict[int, tuple[str, int | None]] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            info.setdefault(id(t), (name, consolidate.shard_dim(t)))
        for master_id, p in self._model_param_of().items():
            info[master_id] = info[id(p)]
        return info

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._split():
            return optimizer.state_dict()
        if self.sharded_checkpoints:  # written by save_checkpoint, shard by shard
            return {"format": SHARDED_KEY}
        if self.zero_engine is not None:
            return self._zero_optimizer_state(optimizer)
        return consolidate.optimizer_state(
            optimizer, self._param_info(), self.groups.tensor, self.groups.pipeline
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if SHARDED_KEY in checkpoint:
            return  # loaded with the model, by _load_sharded
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if saved.get("format") == consolidate.FORMAT and self.zero_engine is not None:
                self._load_zero_optimizer_state(optimizer, saved)
            elif saved.get("format") == consolidate.FORMAT:
                consolidate.load_optimizer_state(
                    optimizer, saved, self._param_info(), self.groups.tensor
                )
            else:
                optimizer.load_state_dict(saved)
            _optimizers_to_device([optimizer], self.root_device)

    def _zero_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """ZeRO's pieces of the optimizer state, gathered over the data group into this rank's
        tensors, then consolidated like any other layout's (by name, full shape)."""
        zero = self.zero_engine
        assert zero is not None
        info = self._param_info()
        by_name = dict(zero.named_params())
        tensors, scalars = consolidate.split_state(
            (
                (by_name[name], entry)
                for name, entry in zero.full_optimizer_state(optimizer).items()
            ),
            info,
        )
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [info[id(p)][0] for p in members],
            }
            for g, members in zip(
                optimizer.param_groups, zero.group_members(optimizer), strict=True
            )
        ]
        return consolidate.named_optimizer_state(
            tensors, scalars, groups, self.groups.tensor, self.groups.pipeline
        )

    def _load_zero_optimizer_state(self, optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
        zero = self.zero_engine
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
        slices = consolidate.local_slices(full, named, self.groups.tensor)
        state = {
            ename: {
                key: slices.get(f"{info[id(p)][0]}\0{key}", value)
                for key, value in saved["state"].get(info[id(p)][0], {}).items()
            }
            for ename, p in zero.named_params()
        }
        zero.load_full_optimizer_state(optimizer, state)
        for group, sg in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in sg.items() if k != "params"})

    def _master_named(self) -> dict[str, tuple[Tensor, int | None]]:
        info = self._param_info()
        masters = self.precision_plugin.masters  # type: ignore[attr-defined]
        return {info[id(m)][0]: (m, info[id(m)][1]) for m in masters.masters}

    def _master_state(self, local: dict[str, Any]) -> dict[str, Any]:
        """The plugin's state with its fp32 masters consolidated by name (a collective); with
        sharded checkpoints without them (they are the checkpoint's model values)."""
        if "masters" not in local or self.zero_engine is not None:
            return local
        if self.sharded_checkpoints:
            return {k: v for k, v in local.items() if k != "masters"}
        full = consolidate.gather_full(
            self._master_named(), self.groups.tensor, self.groups.pipeline
        )
        return {**{k: v for k, v in local.items() if k != "masters"}, "masters_by_name": full}

    def _local_master_state(self, state: dict[str, Any]) -> dict[str, Any]:
        if "masters_by_name" not in state:
            return state
        named = self._master_named()
        slices = consolidate.local_slices(state["masters_by_name"], named, self.groups.tensor)
        masters = [slices[name] for name in named]
        return {**{k: v for k, v in state.items() if k != "masters_by_name"}, "masters": masters}

    # ------------------------------------------------------ sharded checkpoints
    def _layout_state(self) -> LayoutState:
        assert self.parallel is not None
        plugin_masters = getattr(self.precision_plugin, "masters", None)
        masters = {}
        if plugin_masters is not None and self.zero_engine is None:
            masters = {
                id(p): m
                for p, m in zip(plugin_masters.model_params, plugin_masters.masters, strict=True)
            }
        dims, coords = self.dims, self.groups.coords
        return LayoutState(
            self._target_model(),
            (coords.data, coords.pipeline, coords.tensor),
            dims.tensor,
            data_size=dims.data,
            duplicates=self.parallel.duplicates,
            zero=self.zero_engine,
            masters=masters,
            layout={
                "data": dims.data, "pipeline": dims.pipeline, "tensor": dims.tensor,
                "zero": self.zero, "sequence_parallel": dims.sequence_parallel,
            },
        )  # fmt: skip

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Consolidated: rank 0 writes the file. Sharded: every rank writes its shards into the
        folder ``filepath`` (atomically), rank 0 also Lightning's small state. Either way a
        precision plugin's fp32 masters go by name."""
        key = type(self.precision_plugin).__qualname__
        if key in checkpoint and self._split():
            checkpoint[key] = self._master_state(checkpoint[key])
        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ValueError("sharded checkpoints take no storage_options (they write with DCP)")
        optimizers = self.optimizers if "optimizer_states" in checkpoint else []
        self._layout_state().save(filepath, optimizers, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """A sharded checkpoint (a DCP folder) from any layout, or a consolidated file. Of a
        sharded one only Lightning's small state is read here; the tensors follow in
        ``load_model_state_dict``."""
        key = type(self.precision_plugin).__qualname__
        if not is_sharded(checkpoint_path):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            if key in checkpoint and self._split():
                checkpoint[key] = self._local_master_state(checkpoint[key])
            return checkpoint
        checkpoint = read_extra(checkpoint_path)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise ValueError(
                f"{checkpoint_path} is a sharded checkpoint without a Trainer's state (written by "
                "save_zero?): resume from a Trainer checkpoint, or consolidate it and load the "
                "weights yourself"
            )
        checkpoint[SHARDED_KEY] = str(checkpoint_path)
        return checkpoint

    def _load_sharded(self, path: str) -> None:
        """Model and optimizer state from a sharded checkpoint into this rank's tensors, then
        the copies that follow them (ZeRO's compute parameters, a plugin's fp16/bf16 model)."""
        self._layout_state().load(path, self.optimizers)
        if self.zero_engine is not None:
            self.zero_engine.refresh_params()
        else:
            masters = getattr(self.precision_plugin, "masters", None)
            if masters is not None:
                masters.copy_to_model()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab data × pipeline × tensor parallelism"
        )


if "nd" not in StrategyRegistry:
    NDParallelStrategy.register_strategies(StrategyRegistry)
