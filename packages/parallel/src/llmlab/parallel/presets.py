"""The N-D strategy's presets, under the names and arguments their users know.

``strategy=pipeline`` is :class:`~llmlab.parallel.strategy.NDParallelStrategy` with
``tensor = 1`` and ``pipeline = stages`` (``world_size = data × stages``, ranks of one pipeline
consecutive); ``strategy=tensor`` (and ``tensor_sp``) is the same strategy with ``pipeline = 1``:
the model sharded by its own ``tensor_parallel_plan()``, the task's loss the vocab-parallel
cross-entropy, gradients averaged over the data group once per optimizer step. One code path,
two doors. They live beside the strategy they preset, so the ``pipeline`` and ``tensor``
mechanisms never import the strategy that drives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from llmlab.parallel.strategy import NDParallelStrategy


class PipelineStrategy(NDParallelStrategy):
    """Pipeline parallelism over ``stages`` ranks, data parallel over the rest.

    ``schedule``: "naive", "gpipe", "1f1b", "interleaved" (``virtual_stages`` chunks per rank,
    default 2) or the split-backward "zb1", "zbv", "dualpipev" (the last two: 2 chunks in a V).
    ``boundaries``: the first layer index of every virtual stage after the first; by default the
    cut balances parameter count. ``timeline_every_n_steps``: how often to record the timeline,
    log ``pipeline/bubble`` and (rank 0) draw the Gantt chart; 0 turns it off.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        stages: int = 2,
        microbatches: int = 4,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        boundaries: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        pipeline = kwargs.pop("pipeline", stages)
        if pipeline != stages:
            raise ValueError(
                f"pipeline={pipeline!r} and stages={stages!r} are two spellings of the pipeline "
                "degree; set one (stages)"
            )
        super().__init__(
            pipeline=stages,
            microbatches=microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            boundaries=boundaries,
            **kwargs,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab pipeline parallelism (× data parallel)"
        )


if "pipeline" not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)


class TensorParallelStrategy(NDParallelStrategy):
    """Tensor parallelism of ``lightning_module.<model_attribute>`` (× data parallelism).

    ``tensor``: the tensor-parallel degree; ``data``: optional, checked against
    ``world_size / tensor``. ``sequence_parallel``: LayerNorm/dropout/residual on sequence shards
    (all-gather + reduce-scatter instead of all-reduce).
    """

    strategy_name = "tensor"

    def __init__(
        self,
        tensor: int = 2,
        sequence_parallel: bool = False,
        data: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(data=data, tensor=tensor, sequence_parallel=sequence_parallel, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab Megatron-style tensor parallelism (× DP)"
        )


if "tensor" not in StrategyRegistry:
    TensorParallelStrategy.register_strategies(StrategyRegistry)
