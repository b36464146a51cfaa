"""One Lightning step of a pipelined model: the schedule inside, Lightning's contract outside.

Lightning's automatic optimization runs ``training_step`` → ``zero_grad`` → ``backward`` →
``optimizer.step``. A pipeline schedule computes the gradients *inside* the training step (one
backward per micro-batch, interleaved with the forwards), so :class:`PipelinedStep`:

* ``train_step``: sets Lightning's gradients aside (the previous step's, or earlier batches of an
  accumulation window), runs the schedule, keeps what it computed, puts Lightning's back, and
  returns the global batch's mean over its counted tokens on every rank (``train/loss``): each
  micro-batch's loss is weighed by its share of the global count, so micro-batches and data
  replicas holding unequal numbers of counted tokens give one process's loss and gradient
  (:mod:`llmlab.parallel.loss_mean`);
* ``restore_grads``: in Lightning's ``backward``, hands the kept gradients back, divided by the
  accumulation window (Lightning zeroed them in between);
* ``forward``: the forward-only schedule for validation, the last stage's output broadcast to
  every stage (``replaced_model`` stands it in for ``module.<model_attribute>``);
* every ``timeline_every_n_steps`` it records the step's timeline, logs ``pipeline/bubble`` and
  (rank 0) draws the Gantt chart (:mod:`llmlab.parallel.pipeline.timeline`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.loss_mean import counted_tokens
from llmlab.parallel.mesh import ProcessGroups
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.split_layout import last_stage_rank
from llmlab.parallel.pipeline.timeline import gather_events, measured_bubble, plot_timeline
from llmlab.parallel.pipeline.transport import broadcast_tensor

log = logging.getLogger(__name__)


class _PipelinedForward(nn.Module):
    """Stands in for ``module.model`` during validation: ``forward(x)`` runs the forward-only
    schedule and returns the last stage's output on every rank of the pipeline."""

    def __init__(self, run: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self._run = run

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)


class PipelinedStep:
    """The schedule of ``engine`` as Lightning steps, for the parameters ``params`` this rank
    trains, on ``groups`` (its pipeline and data groups)."""

    def __init__(
        self,
        engine: PipelineEngine,
        params: list[nn.Parameter],
        groups: ProcessGroups,
        device: torch.device,
        timeline_every_n_steps: int = 50,
        timeline_dir: str | None = None,
    ) -> None:
        self.engine = engine
        self.loss_fn = engine.loss_fn  # a micro-batch's mean: weighed per step (train_step)
        self.params = params
        self.groups = groups
        self.dims = groups.dims
        self.device = device
        self.timeline_every_n_steps = timeline_every_n_steps
        self.timeline_dir = timeline_dir
        self.last_bubble: float | None = None
        self._kept: list[tuple[nn.Parameter, Tensor]] = []
        # where the loss is computed: the last rank, or the first in a V (ZB-V, DualPipeV)
        self.loss_rank = engine.ranks[
            last_stage_rank(self.dims.schedule, self.dims.pipeline, engine.virtual_stages)
        ]

    @classmethod
    def build(
        cls,
        parallel: Any,
        groups: ProcessGroups,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        device: torch.device,
        scale_loss: Callable[[Tensor], Tensor] | None = None,
        timeline_every_n_steps: int = 50,
        timeline_dir: str | None = None,
    ) -> PipelinedStep:
        """The engine for this rank's stage of ``parallel`` (what ``parallelize_model`` made)
        in its pipeline; ``scale_loss``: the precision plugin's, for every micro-batch."""
        dims, coords = groups.dims, groups.coords
        engine = PipelineEngine(
            parallel.stage.chunks,
            coords.pipeline,
            dims.pipeline,
            ranks=dims.pipeline_ranks(coords),
            loss_fn=loss_fn,
            group=groups.pipeline,
            device=device,
            scale_loss=scale_loss,
        )
        return cls(engine, parallel.params, groups, device, timeline_every_n_steps, timeline_dir)

    # ------------------------------------------------------------------ training
    def train_step(self, module: Any, batch: Any, train_context: Any) -> Tensor:
        """Run the schedule on ``batch`` (``train_context``: the precision plugin's
        ``train_step_context``); returns the global loss, logged as ``train/loss``."""
        inputs, targets = (
            (batch["input"], batch["target"]) if isinstance(batch, Mapping) else batch[:2]
        )
        step = module.trainer.global_step
        every = self.timeline_every_n_steps
        self.engine.record_timeline = every > 0 and step % every == 0
        previous = [p.grad for p in self.params]  # Lightning's: set aside, put back below
        for p in self.params:
            p.grad = None
        self.engine.loss_fn = self._token_weighted(targets)
        with train_context():
            result = self.engine.train_step(
                inputs, targets, self.dims.microbatches, self.dims.schedule
            )
        self._kept = [(p, p.grad) for p in self.params if p.grad is not None]
        for p, grad in zip(self.params, previous, strict=True):
            p.grad = grad
        loss = self._global_loss(result.loss)
        module.log("train/loss", loss, prog_bar=True, sync_dist=False)
        if self.engine.record_timeline:
            self._log_timeline(module, result.events, step)
        return loss

    def _token_weighted(self, targets: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        """The loss of one micro-batch, weighed so that the engine's mean over its ``m``
        micro-batches, averaged over the ``D`` data replicas, is the global token mean:
        ``mean_mb · n_mb · m · D / N`` (``N``: counted tokens of the global batch)."""
        total = counted_tokens(targets).to(self.device)
        if self.dims.data > 1:
            dist.all_reduce(total, group=self.groups.data)
        scale = self.dims.microbatches * self.dims.data / max(int(total), 1)
        loss_fn = self.loss_fn

        def weighted(output: Tensor, target: Tensor) -> Tensor:
            return loss_fn(output, target) * (counted_tokens(target) * scale)

        return weighted

    def restore_grads(self, accumulate: int) -> None:
        """The gradients the schedule computed, added to ``.grad`` (``/ accumulate``)."""
        for p, grad in self._kept:
            grad = grad / accumulate if accumulate > 1 else grad
            p.grad = grad if p.grad is None else p.grad + grad
        self._kept = []

    def take_bytes_sent(self) -> int:
        """Activation and gradient bytes sent to other stages since the last call."""
        sent, self.engine.transport.bytes_sent = self.engine.transport.bytes_sent, 0
        return sent

    def _global_loss(self, loss: Tensor | None) -> Tensor:
        """The last virtual stage's loss on every rank, averaged over data-parallel replicas."""
        value = torch.zeros((), device=self.device, dtype=torch.float32)
        if loss is not None:
            value += loss.detach().float()
        dist.broadcast(value, self.loss_rank, group=self.groups.pipeline)
        if self.dims.data > 1:
            dist.all_reduce(value, group=self.groups.data)
            value /= self.dims.data
        return value

    # ---------------------------------------------------------------- validation
    def forward(self, inputs: Tensor) -> Tensor:
        """The forward-only schedule; the last stage's output on every rank of the pipeline."""
        m = self.dims.microbatches if inputs.shape[0] % self.dims.microbatches == 0 else 1
        result = self.engine.eval_step(inputs, None, m, self.dims.schedule)
        output = result.output.float() if result.output is not None else None
        return broadcast_tensor(output, self.loss_rank, self.groups.pipeline, self.device)

    @contextmanager
    def replaced_model(self, module: Any, attribute: str) -> Generator[None, None, None]:
        """``module.<attribute>`` runs the pipeline's forward while the block runs."""
        real = getattr(module, attribute)
        setattr(module, attribute, _PipelinedForward(self.forward))
        try:
            yield
        finally:
            setattr(module, attribute, real)

    # ------------------------------------------------------------------ timeline
    def _log_timeline(self, module: Any, events: list, step: int) -> None:
        pipeline = self.dims.pipeline
        merged = gather_events(events, self.groups.pipeline)
        self.last_bubble = measured_bubble(merged, pipeline)
        module.log("pipeline/bubble", self.last_bubble, sync_dist=False)
        trainer = module.trainer
        if not trainer.is_global_zero:
            return
        out_dir = Path(self.timeline_dir or trainer.default_root_dir)
        path = plot_timeline(
            merged,
            pipeline,
            out_dir / "timelines" / f"pipeline-step{step:06d}.png",
            title=f"{self.dims.schedule} p={pipeline} m={self.dims.microbatches} step {step}",
        )
        logger = trainer.logger
        if logger is not None and hasattr(logger, "log_image"):
            try:
                logger.log_image("pipeline/timeline", [str(path)], step=step)
            except Exception as err:  # a disabled or offline logger must not stop training
                log.warning("could not log the pipeline timeline: %s", err)
