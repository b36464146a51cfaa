"""The N-D strategy's option checks: :func:`check_options` needs no world and no model (ZeRO
stage and implementation, compile, split-backward schedules, context and expert parallelism
against each other); :func:`check_run` judges the same options against a run's precision,
model, world and batch.

``NDParallelStrategy`` calls :func:`check_options` in its constructor, so a bad combination is
refused where it is written (user code, the app's ``check_config``), before any process starts;
its ``check_config`` adds :func:`check_run` for the app.
"""

from __future__ import annotations

from llmlab.parallel.context.step import check_context
from llmlab.parallel.data.sharding import check_zero_impl
from llmlab.parallel.data.zero import STAGES as ZERO_STAGES
from llmlab.parallel.expert import check_has_experts, expert_refusal
from llmlab.parallel.mesh import ParallelDims, check_layout
from llmlab.parallel.pipeline.split_layout import check_split_backward
from llmlab.parallel.preflight import RunConfig
from llmlab.parallel.transforms import ModelTransforms

ZERO_WITH_PIPELINE = (
    "a pipeline runs several micro-batch backward passes per step, so ZeRO-2 would either keep "
    "every full gradient until the step (no saving) or reduce-scatter after every micro-batch "
    "(microbatches x the data traffic), and ZeRO-3 would gather each block's parameters twice "
    "per micro-batch while the schedule interleaves the micro-batches' forwards and backwards. "
    "DeepSpeed refuses ZeRO-2/3 with its pipeline engine for the same reason; use zero=1 with "
    "pipeline > 1 (or ZeRO-2/3 with data x tensor)"
)


def check_options(
    dims: ParallelDims,
    zero: int,
    zero_impl: str,
    transforms: ModelTransforms,
) -> None:
    """Raise ``ValueError`` naming the values for the first combination that cannot be exact."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"strategy.zero must be one of {ZERO_STAGES}, got {zero!r}")
    if zero >= 2 and dims.pipeline > 1:
        raise ValueError(
            f"strategy.zero={zero} with strategy.pipeline={dims.pipeline} is refused: "
            f"{ZERO_WITH_PIPELINE}"
        )
    check_split_backward(dims.schedule, transforms.compile)  # zb1/zbv/dualpipev: exact only
    check_context(dims.context, transforms)
    check_zero_impl(zero_impl, zero, dims.pipeline, transforms)


def check_run(dims: ParallelDims, zero: int, zero_impl: str, run: RunConfig) -> None:
    """The options against the run: the split-backward schedule and ZeRO implementation with
    its precision, expert parallelism with a model that has experts, the layout with
    the world, batch and model (built on ``meta`` only when tensor, pipeline or expert > 1),
    context parallelism with the sequence length and dropout."""
    check_split_backward(dims.schedule, run.transforms.compile, run.plugin_options)
    check_zero_impl(zero_impl, zero, dims.pipeline, None, run.plugin, run.precision)
    if dims.expert > 1 and zero > 0 and _keeps_masters(run.plugin):
        raise ValueError(expert_refusal("precision", run.plugin.__name__, dims.expert))
    model = run.model() if dims.tensor > 1 or dims.pipeline > 1 or dims.expert > 1 else None
    if dims.expert > 1 and model is not None:
        check_has_experts(model, dims.expert)
    check_layout(dims, world_size=run.world_size, model=model, global_batch=run.global_batch)
    check_context(dims.context, run.transforms, run.seq_len, run.attention_dropout)


def _keeps_masters(plugin: type | None) -> bool:
    """A precision plugin with fp32 master weights and a loss scale: under ZeRO the engine's
    shards are the masters (``ZeroMasterWeights``), which expert slices are not."""
    from llmlab.parallel.precision.plugins import MasterWeightPrecision

    return plugin is not None and issubclass(plugin, MasterWeightPrecision)
