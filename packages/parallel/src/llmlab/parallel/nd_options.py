"""The N-D strategy's option checks that need no world and no model: ZeRO stage and
implementation, compile, split-backward schedules and context parallelism against each other.

``NDParallelStrategy`` calls :func:`check_options` in its constructor, so a bad combination is
refused where it is written (user code, the app's ``check_config``), before any process starts.
"""

from __future__ import annotations

from llmlab.parallel.compile import COMPILE_WITH_TENSOR
from llmlab.parallel.context.step import check_context
from llmlab.parallel.data.sharding import check_zero_impl
from llmlab.parallel.data.zero import STAGES as ZERO_STAGES
from llmlab.parallel.expert import expert_refusal
from llmlab.parallel.mesh import ParallelDims
from llmlab.parallel.pipeline.split_layout import check_split_backward
from llmlab.parallel.transforms import ModelTransforms

ZERO_WITH_PIPELINE = (
    "a pipeline runs several micro-batch backward passes per step, so ZeRO-2 would either keep "
    "every full gradient until the step (no saving) or reduce-scatter after every micro-batch "
    "(microbatches x the data traffic), and ZeRO-3 would gather each block's parameters twice "
    "per micro-batch while the schedule interleaves the micro-batches' forwards and backwards. "
    "DeepSpeed refuses ZeRO-2/3 with its pipeline engine for the same reason; use zero=1 with "
    "pipeline > 1 (or ZeRO-2/3 with data x tensor)"
)


def check_expert(
    dims: ParallelDims, zero: int, transforms: ModelTransforms, sharded_checkpoints: bool = False
) -> None:
    """What ``expert > 1`` was checked with: data × context, fp32, no ZeRO, compile or
    activation checkpointing (:data:`llmlab.parallel.expert.EXPERT_REFUSALS` says why)."""
    if dims.expert == 1:
        return
    for what, value, bad in (
        ("strategy.pipeline", dims.pipeline, dims.pipeline > 1),
        ("strategy.tensor", dims.tensor, dims.tensor > 1),
        ("strategy.zero", zero, zero > 0),
        ("compile", True, transforms.compile),
        ("activation_checkpointing", transforms.activation_checkpointing,
         transforms.activation_checkpointing is not None),
        ("strategy.sharded_checkpoints", True, sharded_checkpoints),
    ):  # fmt: skip
        if bad:
            raise ValueError(expert_refusal(what, value, dims.expert))


def check_options(
    dims: ParallelDims,
    zero: int,
    zero_impl: str,
    transforms: ModelTransforms,
    sharded_checkpoints: bool = False,
) -> None:
    """Raise ``ValueError`` naming the values for the first combination that cannot be exact."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"strategy.zero must be one of {ZERO_STAGES}, got {zero!r}")
    if zero >= 2 and dims.pipeline > 1:
        raise ValueError(
            f"strategy.zero={zero} with strategy.pipeline={dims.pipeline} is refused: "
            f"{ZERO_WITH_PIPELINE}"
        )
    if transforms.compile and dims.tensor > 1:
        raise ValueError(COMPILE_WITH_TENSOR)
    check_split_backward(dims.schedule, transforms.compile)  # zb1/zbv/dualpipev: exact only
    check_context(dims.context, transforms)
    check_zero_impl(zero_impl, zero, dims.pipeline, transforms, context=dims.context)
    check_expert(dims, zero, transforms, sharded_checkpoints)
