"""Model parallelism inside one process: the seed notes' two-device split of ResNet-50.

``ModelParallel`` places contiguous parts of ``pipeline_layers()`` on a list of devices
(``cuda:0``, ``cuda:1`` on a GPU machine; all ``cpu`` here, the same code path) and moves the
activation across at each cut: while one device computes, the others wait -- the naive schedule.

``MicroBatchedModelParallel`` is the seed's pipelined variant: the batch is split into
micro-batches, and while part ``k`` works on micro-batch ``i`` part ``k-1`` already starts on
``i+1``. CUDA kernels launch asynchronously, so the devices overlap for real on a GPU; on a CPU
the order of work is the same but nothing overlaps. Autograd sees the same graph either way, so
its gradients equal gradient accumulation over the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from torch import Tensor, nn

from llmlab.parallel.pipeline.partition import split_ranges
from llmlab.parallel.pipeline.stage import pipeline_layers_of
from llmlab.parallel.preflight import RunConfig, check_data_parallel


class ModelParallel(nn.Module):
    """``model``'s pipeline layers cut into ``len(devices)`` parts, part ``k`` on ``devices[k]``."""

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[str | torch.device],
        boundaries: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not devices:
            raise ValueError("ModelParallel needs at least one device")
        layers = pipeline_layers_of(model)
        ranges = split_ranges(layers, len(devices), boundaries)
        self.devices = [torch.device(d) for d in devices]
        self.parts = nn.ModuleList(
            nn.Sequential(*(layers[i] for i in r)).to(dev) for r, dev in zip(ranges, self.devices)
        )
        self.ranges = ranges

    def forward(self, x: Tensor) -> Tensor:
        for part, device in zip(self.parts, self.devices):
            x = part(x.to(device))
        return x

    def _apply(self, fn, recurse=True):
        # Trainers move "the model" to one device; the parts must stay where they were placed
        # (dtype conversions still apply).
        super()._apply(fn, recurse)
        for part, device in zip(self.parts, self.devices):
            part.to(device)
        return self


class MicroBatchedModelParallel(ModelParallel):
    """``ModelParallel`` fed ``microbatches`` slices of the batch in a staggered order."""

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[str | torch.device],
        microbatches: int,
        boundaries: Sequence[int] | None = None,
    ) -> None:
        super().__init__(model, devices, boundaries)
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        self.microbatches = microbatches

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] % self.microbatches != 0:
            raise ValueError(
                f"batch of {x.shape[0]} cannot be split into {self.microbatches} equal "
                f"micro-batches; use a multiple of {self.microbatches}"
            )
        pending = list(x.chunk(self.microbatches))
        k = len(self.parts)
        # in_flight[j]: the activation waiting to enter part j. Each tick, every part with an
        # input works on it (highest part first, so a part's output moves on next tick).
        in_flight: list[Tensor | None] = [None] * k
        outputs: list[Tensor] = []
        while pending or any(a is not None for a in in_flight):
            for j in reversed(range(k)):
                if in_flight[j] is None:
                    continue
                out = self.parts[j](in_flight[j].to(self.devices[j]))
                in_flight[j] = None
                if j + 1 < k:
                    in_flight[j + 1] = out
                else:
                    outputs.append(out)
            if pending:
                in_flight[0] = pending.pop(0)
        return torch.cat(outputs)


def split_across_devices(
    model: nn.Module, devices: Sequence[str | torch.device], microbatches: int = 1
) -> ModelParallel:
    """``model`` split over ``devices``, micro-batched when ``microbatches`` > 1."""
    if microbatches > 1:
        return MicroBatchedModelParallel(model, devices, microbatches)
    return ModelParallel(model, devices)


class NaiveModelParallelStrategy(SingleDeviceStrategy):
    """One process, the model's pipeline layers split over ``devices`` (``strategy=naive_mp``).

    The split is placement, not a property of the model or the task, so a strategy applies it
    (to ``lightning_module.<model_attribute>``) when Lightning sets it up -- as every llmlab
    strategy transforms the model it is given. The input batch starts on ``devices[0]``; the
    loss is computed where the last part leaves the output.
    """

    strategy_name = "naive_mp"

    def __init__(
        self,
        devices: Sequence[str] = ("cpu", "cpu"),
        microbatches: int = 1,
        model_attribute: str = "model",
        **kwargs: Any,
    ) -> None:
        devices = list(devices)
        if len(devices) < 2:
            raise ValueError(
                f"strategy.devices needs at least two devices to split over, got {devices}"
            )
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(
                f"strategy.microbatches must be a positive integer, got {microbatches!r}"
            )
        super().__init__(device=devices[0], **kwargs)
        self.split_devices = devices
        self.microbatches = microbatches
        self.model_attribute = model_attribute

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """The constructor's checks; then what was checked against the unsplit model: fp32, no
        memory transforms, no compile (anything else is refused, naming it)."""
        cls(**options)
        precision = run.plugin.__name__ if run.plugin is not None else run.precision
        if run.plugin is not None or precision not in (None, "32-true") or run.transforms.active:
            raise ValueError(
                "strategy=naive_mp was checked against the unsplit model in fp32 without memory "
                f"transforms only; got precision={precision}, model_transforms={run.transforms}; "
                "use precision=fp32 and model_transforms={} with it"
            )
        check_data_parallel(run)

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        model = getattr(module, self.model_attribute)
        if not isinstance(model, ModelParallel):  # Lightning sets up again for validate/test
            split = split_across_devices(model, self.split_devices, self.microbatches)
            setattr(module, self.model_attribute, split)
        super().setup(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab one-process model parallelism"
        )


if NaiveModelParallelStrategy.strategy_name not in StrategyRegistry:
    NaiveModelParallelStrategy.register_strategies(StrategyRegistry)
