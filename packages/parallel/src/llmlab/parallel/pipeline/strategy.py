"""``PipelineStrategy``: pipeline parallelism (× data parallelism) as a Lightning strategy.

Lightning assumes one process computes a whole forward and backward. Here the strategy owns the
step instead (DESIGN §4):

* ``setup`` cuts ``lightning_module.model.pipeline_layers()`` into stages, drops every parameter
  and buffer this rank's stage does not use (so each rank holds only its share) and builds the
  optimizer from what is left;
* ``training_step`` runs the schedule (forwards, backwards, point-to-point transfers, tied-weight
  and data-parallel gradient reduction) and keeps the gradients aside, because Lightning's
  automatic optimization calls ``optimizer.zero_grad()`` *after* ``training_step``;
* ``backward`` does no backward: it puts the kept gradients back (divided by
  ``accumulate_grad_batches``), between Lightning's backward hooks;
* gradient clipping by norm uses the norm of the whole model, summed over stages;
* ``validation_step`` runs the forward-only schedule and hands the last stage's outputs to the
  module's own ``validation_step`` (broadcast to the pipeline), so metrics stay the module's;
* checkpoints are consolidated: the model state dict has the unsplit model's keys and the
  optimizer state is keyed by parameter name, so a checkpoint from any layout loads into a
  plain model or into any other layout.

Layout: ``world_size = data × stages``; ranks of one pipeline are consecutive
(``llmlab.parallel.mesh``). The data module must shard by the *data-parallel* rank, which
``distributed_sampler_kwargs`` reports, so all stages of one pipeline see the same batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.grads import GradientReducer, clip_grad_norm_global
from llmlab.parallel.pipeline.schedules import validate_schedule_args
from llmlab.parallel.pipeline.stage import (
    StageModules,
    build_tie_groups,
    cut_stage,
    pipeline_layers_of,
)
from llmlab.parallel.pipeline.timeline import gather_events, measured_bubble, plot_timeline

log = logging.getLogger(__name__)
CONSOLIDATED = "llmlab.pipeline.consolidated/1"


def prune_to_stage(model: nn.Module, keep: Sequence[nn.Module]) -> int:
    """Replace every parameter and buffer of ``model`` that no module in ``keep`` uses by a
    storage-less ``meta`` tensor of the same shape; returns the parameters actually held.

    The module tree, names and shapes stay those of the unsplit model, so code that only reads
    metadata (``numel()`` for a FLOP count, the task's grouping of parameters by module type)
    still works; the memory goes. A tied weight used by a kept layer survives under every name
    it has, and a dropped tied weight stays tied (one placeholder per original tensor).
    """
    keep_params = {id(p) for m in keep for p in m.parameters()}
    keep_buffers = {id(b) for m in keep for b in m.buffers()}
    placeholders: dict[int, Tensor] = {}

    def placeholder(t: Tensor, param: bool) -> Tensor:
        if id(t) not in placeholders:
            empty = torch.empty_like(t, device="meta")
            placeholders[id(t)] = nn.Parameter(empty, t.requires_grad) if param else empty
        return placeholders[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in keep_params:
                module._parameters[name] = placeholder(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) not in keep_buffers:
                module._buffers[name] = placeholder(b, False)
    return held_parameter_count(model)


def held_parameter_count(model: nn.Module) -> int:
    """Parameters with storage on this rank (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if not p.is_meta)


def _move_held_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors this rank holds, leaving ``meta`` placeholders
    (which cannot be copied) alone and keeping tied parameters tied."""
    moved: dict[int, Tensor] = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None or t.is_meta or t.device == device:
                    continue
                if id(t) not in moved:
                    data = t.data.to(device)
                    moved[id(t)] = (
                        nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                    )
                store[name] = moved[id(t)]


class _PipelinedForward(nn.Module):
    """Stands in for ``module.model`` during validation: ``forward(x)`` runs the forward-only
    schedule and returns the last stage's output on every rank of the pipeline."""

    def __init__(self, run: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self._run = run

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)


class PipelineStrategy(DDPStrategy):
    """Pipeline parallelism over ``stages`` ranks, data parallel over the rest.

    ``schedule``: "naive", "gpipe", "1f1b" or "interleaved" (``virtual_stages`` chunks per rank,
    default 2). ``boundaries``: the first layer index of every virtual stage after the first;
    by default the cut balances parameter count. ``timeline_every_n_steps``: how often to record
    the timeline, log ``pipeline/bubble`` and (rank 0) draw the Gantt chart; 0 turns it off.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        stages: int = 2,
        microbatches: int = 4,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        boundaries: Sequence[int] | None = None,
        model_attribute: str = "model",
        timeline_every_n_steps: int = 50,
        timeline_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if virtual_stages is None:
            virtual_stages = 2 if schedule == "interleaved" else 1
        if schedule == "interleaved" and microbatches % stages != 0:
            raise ValueError(
                f"the interleaved schedule needs microbatches ({microbatches}) to be a multiple "
                f"of stages ({stages})"
            )
        validate_schedule_args(schedule, stages, microbatches, virtual_stages)
        self.stages = stages
        self.microbatches = microbatches
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.boundaries = list(boundaries) if boundaries is not None else None
        self.model_attribute = model_attribute
        self.timeline_every_n_steps = timeline_every_n_steps
        self.timeline_dir = timeline_dir
        self._groups: ProcessGroups | None = None
        self._stage: StageModules | None = None
        self._engine: PipelineEngine | None = None
        self._kept_grads: list[tuple[nn.Parameter, Tensor]] = []
        self._names: dict[int, str] = {}
        self.last_bubble: float | None = None
        self.local_param_count = 0

    # ------------------------------------------------------------------- layout
    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.infer(self.world_size, pipeline=self.stages)

    @property
    def stage_index(self) -> int:
        return self.dims.coords(self.global_rank)[1]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel replica count and index: every stage of a pipeline reads the same
        batches."""
        dims = self.dims
        return {"num_replicas": dims.data, "rank": dims.coords(self.global_rank)[0]}

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        return self._groups.pipeline if self._groups else None

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.stages - 1

    # -------------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        dims = self.dims  # raises, naming the numbers, when world size % stages != 0
        self._groups = build_process_groups(dims)
        module = self.lightning_module
        model = getattr(module, self.model_attribute, None)
        if model is None:
            raise TypeError(
                f"{type(module).__name__} has no attribute {self.model_attribute!r}; "
                "PipelineStrategy pipelines lightning_module.<model_attribute>"
            )
        layers = pipeline_layers_of(model)
        stage = self.stage_index
        self._stage = cut_stage(layers, self.stages, stage, self.virtual_stages, self.boundaries)
        self._check_batch_size(trainer, dims)
        pipelines = [[dims.rank_of(d, s, 0) for s in range(self.stages)] for d in range(dims.data)]
        tied = build_tie_groups(self._stage, pipelines)
        self.local_param_count = prune_to_stage(model, self._stage.chunks)
        log.info(
            "pipeline stage %d/%d holds layers %s (%d parameters)",
            stage,
            self.stages,
            self._stage.local_layers,
            self.local_param_count,
        )
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        params = self._unique_params()
        self._names = {id(p): n for n, p in module.named_parameters()}
        reducer = GradientReducer(params, tied, self._groups.data, dims.data)
        self._engine = PipelineEngine(
            self._stage.chunks,
            stage,
            self.stages,
            ranks=pipelines[dims.coords(self.global_rank)[0]],
            loss_fn=lambda out, target: module.loss_fn(out, target),
            group=self._groups.pipeline,
            reduce_grads=reducer,
            device=self.root_device,
        )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:  # placeholders of other stages' weights: not ours
                for group in optimizer.param_groups:
                    group["params"] = [p for p in group["params"] if not p.is_meta]
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the local norm; a stage must clip with the whole model's norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _unique_params(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        out = []
        for chunk in self._stage.chunks if self._stage else []:
            for p in chunk.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _check_batch_size(self, trainer: pl.Trainer, dims: ParallelDims) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        size = getattr(datamodule, "batch_size", None)
        if not isinstance(size, int):
            return
        per_replica = size // dims.data if size % dims.data == 0 else None
        if per_replica is None or per_replica % self.microbatches != 0:
            raise ValueError(
                f"batch size {size} over {dims.data} data-parallel replica(s) cannot be split "
                f"into {self.microbatches} equal micro-batches; use a batch size that is a "
                f"multiple of {dims.data * self.microbatches}"
            )

    def model_to_device(self) -> None:
        assert self.model is not None
        _move_held_tensors(self.model, self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown, except that the module goes back to the CPU tensor by tensor
        (``module.cpu()`` cannot copy the other stages' ``meta`` placeholders)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            _move_held_tensors(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---------------------------------------------------------------- training
    def _split(self, batch: Any) -> tuple[Tensor, Tensor]:
        if isinstance(batch, Mapping):
            return batch["input"], batch["target"]
        inputs, targets = batch[0], batch[1]
        return inputs, targets

    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self._engine is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = self._split(batch)
        step = self.lightning_module.trainer.global_step
        record = self.timeline_every_n_steps > 0 and step % self.timeline_every_n_steps == 0
        self._engine.record_timeline = record
        # The schedule accumulates into .grad; what is there now belongs to Lightning (the
        # previous step's gradients, cleared by the zero_grad that follows this training_step,
        # or earlier batches of an accumulation window), so set it aside and put it back.
        params = self._unique_params()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            result = self._engine.train_step(inputs, targets, self.microbatches, self.schedule)
        self._kept_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, previous):
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
        if self._groups is not None and self.world_size > 1:
            src = self._engine.ranks[-1]  # type: ignore[union-attr]
            dist.broadcast(value, src, group=self._groups.pipeline)
            if self.dims.data > 1:
                dist.all_reduce(value, group=self._groups.data)
                value /= self.dims.data
        return value

    def _log_timeline(self, events: list, step: int) -> None:
        merged = gather_events(events, self.pipeline_group)
        self.last_bubble = measured_bubble(merged, self.stages)
        self.lightning_module.log("pipeline/bubble", self.last_bubble, sync_dist=False)
        if not self.is_global_zero:
            return
        out_dir = Path(self.timeline_dir or self.lightning_module.trainer.default_root_dir)
        path = plot_timeline(
            merged,
            self.stages,
            out_dir / "timelines" / f"pipeline-step{step:06d}.png",
            title=f"{self.schedule} p={self.stages} m={self.microbatches} step {step}",
        )
        logger = self.lightning_module.trainer.logger
        if logger is not None and hasattr(logger, "log_image"):
            try:
                logger.log_image("pipeline/timeline", [str(path)], step=step)
            except Exception as err:  # a disabled or offline logger must not stop training
                log.warning("could not log the pipeline timeline: %s", err)

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """No autograd here: restore the gradients the schedule computed in ``training_step``."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accumulate = max(1, int(module.trainer.accumulate_grad_batches))
        for p, grad in self._kept_grads:
            grad = grad / accumulate if accumulate > 1 else grad
            p.grad = grad if p.grad is None else p.grad + grad
        self._kept_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        duplicates = self._stage.duplicate_copies if self._stage else []
        clip_grad_norm_global(params, float(clip_val), self.pipeline_group, exclude=duplicates)

    # -------------------------------------------------------------- validation
    def _pipelined_forward(self, inputs: Tensor) -> Tensor:
        assert self._engine is not None
        m = self.microbatches if inputs.shape[0] % self.microbatches == 0 else 1
        result = self._engine.eval_step(inputs, None, m, self.schedule)
        return self._broadcast_from_last(result.output)

    def _broadcast_from_last(self, output: Tensor | None) -> Tensor:
        if self.stages == 1:
            assert output is not None
            return output
        src = self._engine.ranks[-1]  # type: ignore[union-attr]
        group = self.pipeline_group
        header = torch.zeros(10, dtype=torch.int64, device=self.root_device)
        if output is not None:
            header[0] = output.dim()
            header[1 : 1 + output.dim()] = torch.tensor(output.shape)
        dist.broadcast(header, src, group=group)
        shape = header[1 : 1 + int(header[0])].tolist()
        if output is None:
            output = torch.empty(shape, dtype=torch.float32, device=self.root_device)
        output = output.float().contiguous()
        dist.broadcast(output, src, group=group)
        return output

    @contextmanager
    def _model_replaced(self):
        module = self.lightning_module
        real = getattr(module, self.model_attribute)
        setattr(module, self.model_attribute, _PipelinedForward(self._pipelined_forward))
        try:
            yield
        finally:
            setattr(module, self.model_attribute, real)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self._model_replaced():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self._model_replaced():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self._model_replaced():
            return self.lightning_module.predict_step(*args, **kwargs)

    # -------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit model's state dict: the union of every stage's (collective)."""
        local = {
            k: v.detach().cpu()
            for k, v in self.lightning_module.state_dict().items()
            if not (isinstance(v, Tensor) and v.is_meta)
        }
        if self.stages == 1 or self.pipeline_group is None:
            return local
        parts: list[dict | None] = [None] * self.stages
        dist.all_gather_object(parts, local, group=self.pipeline_group)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a consolidated state dict: each rank takes the keys its stage holds."""
        module = self.lightning_module
        full = checkpoint["state_dict"]
        if self._stage is None:  # not split yet: the whole model loads as usual
            module.load_state_dict(full, strict=strict)
            return
        wanted = [
            k for k, v in module.state_dict().items() if not (isinstance(v, Tensor) and v.is_meta)
        ]
        missing = [k for k in wanted if k not in full]
        if strict and missing:
            raise KeyError(f"checkpoint lacks keys this pipeline stage needs: {missing[:5]}")
        with torch.no_grad():  # copy into the held tensors; placeholders keep no values
            held = dict(module.state_dict(keep_vars=True))
            for k in wanted:
                if k in full:
                    held[k].copy_(full[k])

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name and merged over stages (collective)."""
        sd = optimizer.state_dict()
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        names = [self._names.get(id(p), f"#unnamed{i}") for i, p in enumerate(flat)]
        state = {names[i]: _to_cpu(s) for i, s in sd["state"].items()}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[i] for i in g["params"]],
            }
            for g in sd["param_groups"]
        ]
        parts: list[Any] = [(state, groups)]
        if self.stages > 1 and self.pipeline_group is not None:
            parts = [None] * self.stages
            dist.all_gather_object(parts, (state, groups), group=self.pipeline_group)
        merged_state: dict[str, Any] = {}
        merged_groups = [dict(g, params=[]) for g in groups]
        for part_state, part_groups in parts:
            merged_state.update(part_state)
            for g, pg in zip(merged_groups, part_groups):
                g["params"] += [n for n in pg["params"] if n not in g["params"]]
        return {"format": CONSOLIDATED, "state": merged_state, "param_groups": merged_groups}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            if saved.get("format") != CONSOLIDATED:
                optimizer.load_state_dict(saved)
            else:
                optimizer.load_state_dict(self._local_optimizer_state(optimizer, saved))
            _optimizers_to_device([optimizer], self.root_device)

    def _local_optimizer_state(self, optimizer: Optimizer, saved: Mapping[str, Any]) -> dict:
        state, groups, index = {}, [], 0
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved['param_groups'])} optimizer parameter groups, this "
                f"optimizer {len(optimizer.param_groups)}"
            )
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            ids = []
            for p in group["params"]:
                name = self._names[id(p)]
                if name in saved["state"]:
                    state[index] = saved["state"][name]
                ids.append(index)
                index += 1
            groups.append(
                {**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids}
            )
        return {"state": state, "param_groups": groups}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab pipeline parallelism (× data parallel)"
        )


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


if "pipeline" not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)
