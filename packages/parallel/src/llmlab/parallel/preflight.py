"""Checking a strategy's config before any process starts: each strategy judges its own.

A strategy knows which layouts, precisions and transforms it runs exactly; the app does not, and
must not guess from class names. So every llmlab strategy has a classmethod

    check_config(options: Mapping[str, Any], run: RunConfig) -> None

that raises ``ValueError`` (or ``TypeError`` for a model that lacks a contract) naming the bad
value and what would be valid. ``options`` are the strategy's own constructor arguments (its
config node without ``_target_``); :class:`RunConfig` is what it needs to know about the rest of
the run. :func:`check_strategy_config` is the one call the app makes: the strategy's own check,
or, for Lightning's strategies (``auto``, ``ddp``, ``DDPStrategy``), data parallelism over the
world.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from llmlab.parallel.compile import compile_refusal
from llmlab.parallel.mesh import ParallelDims, check_layout
from llmlab.parallel.transforms import ModelTransforms

# Lightning's own data-parallel strategies, run as they are (compile=true was checked with them).
LIGHTNING_DATA_PARALLEL = ("auto", "ddp", "DDPStrategy", "SingleDeviceStrategy")


@dataclass
class RunConfig:
    """What a strategy needs to know about the rest of a run to judge its own config.

    ``world_size``: trainer devices × nodes. ``global_batch``: the data module's batch size
    (``None``: unknown). ``precision``: Lightning's precision flag when no plugin is given;
    ``plugin``: the precision plugin's class, if any; ``plugin_options``: its arguments.
    ``transforms``: the memory options and ``compile``, parsed once. ``gradient_clip_val`` /
    ``gradient_clip_algorithm``: the trainer's. ``seq_len``: the training sequence length (the
    data's block size; ``None``: unknown); ``attention_dropout``: the model's dropout on
    attention probabilities (context parallelism has none). ``build_model``: builds the task's
    model (on the ``meta`` device: no memory), called only by a check that needs the model's
    shape, at most once.
    """

    world_size: int
    global_batch: int | None = None
    precision: str | None = "32-true"
    plugin: type | None = None
    plugin_options: Mapping[str, Any] = field(default_factory=dict)
    transforms: ModelTransforms = field(default_factory=ModelTransforms)
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    seq_len: int | None = None
    attention_dropout: float | None = None
    build_model: Callable[[], nn.Module] | None = field(default=None, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)

    def model(self) -> nn.Module | None:
        """The task's model (built once, on first use), or ``None`` when none can be built."""
        if self._model is None and self.build_model is not None:
            self._model = self.build_model()
        return self._model


def check_data_parallel(run: RunConfig) -> None:
    """Data parallelism over the whole world: every rank a replica of the global batch."""
    check_layout(ParallelDims(data=None), world_size=run.world_size, global_batch=run.global_batch)


def check_strategy_config(strategy: type | str, options: Mapping[str, Any], run: RunConfig) -> None:
    """``strategy`` (a class, or a Lightning registry name) judges ``options`` in ``run``."""
    check = getattr(strategy, "check_config", None)
    if callable(check):
        check(options, run)
        return
    name = strategy if isinstance(strategy, str) else strategy.__name__
    if run.transforms.compile and name not in LIGHTNING_DATA_PARALLEL:
        raise ValueError(compile_refusal(name))
    check_data_parallel(run)
