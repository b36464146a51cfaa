"""``TensorParallelStrategy``: Megatron-style tensor parallelism (× data parallelism), a preset of
the N-D strategy.

``strategy=tensor`` (and ``tensor_sp``) is :class:`~llmlab.parallel.strategy.NDParallelStrategy`
with ``pipeline = 1``: the model is sharded by its own ``tensor_parallel_plan()``, the task's
loss becomes the vocab-parallel cross-entropy, the forward and backward are the task's own, and
gradients are averaged over the data group once per optimizer step.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from llmlab.parallel.strategy import NDParallelStrategy


class TensorParallelStrategy(NDParallelStrategy):
    """Tensor parallelism of ``lightning_module.<model_attribute>`` (× data parallelism).

    ``tensor``: the tensor-parallel degree; ``data``: optional, checked against
    ``world_size / tensor``. ``sequence_parallel``: LayerNorm/dropout/residual on sequence shards
    (all-gather + reduce-scatter instead of all-reduce).
    """

    strategy_name = "tensor"
    # measured: its sharded blocks recompile until dynamo's recompile_limit, then silently run
    # eager; refused by check_config with the strategy's name
    compile_checked = False

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
