"""``parallelize_model``: how a plain model becomes parallel, on one screen.

torchtitan's ``parallelize_llama`` is the example: the model is written for one device, and every
transformation is applied from outside, here, in one stated order. Strategies call this function;
tasks and the app never transform a model.

    1. tensor parallelism      shard the layers the model's ``tensor_parallel_plan()`` names
    2. sequence parallelism    norms / dropout / residual adds on sequence shards (part of 1)
    3. memory                  recompute attention, activation checkpointing of repeated blocks
    4. pipeline stage split    keep this stage's ``pipeline_layers()``, free the rest
    5. precision               the precision plugin converts what is left
    6. compile                 each repeated block compiled in place (``compile=true``)
    7. data parallel / ZeRO    the strategy's gradient reducer, built from ``ParallelModel.params``

Why this order: sharding swaps ``nn.Linear`` modules, so it comes before anything that wraps
blocks (a checkpoint wrapper would hide them); the pipeline cut comes after both so that every
stage holds already-sharded, already-wrapped layers and a tied weight stays one object; precision
converts only what this rank keeps, so fp32 master weights are the shards the optimizer holds.

The model meets the contracts in :mod:`llmlab.parallel.contracts` structurally; nothing here
knows a model class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.parallel.compile import COMPILE_WITH_TENSOR, compile_blocks, compile_loss
from llmlab.parallel.contracts import (
    TensorParallelShardable,
    require,
    tensor_parallel_problems,
)
from llmlab.parallel.memory import apply_activation_checkpointing, use_recompute_attention
from llmlab.parallel.mesh import ParallelDims, ProcessGroups
from llmlab.parallel.pipeline.stage import (
    StageModules,
    build_tie_groups,
    cut_stage,
    pipeline_layers_of,
    prune_to_stage,
)
from llmlab.parallel.tensor.cross_entropy import VocabParallelCrossEntropy
from llmlab.parallel.tensor.sharding import parallelize

LossFn = Callable[[Tensor, Tensor], Tensor]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelTransforms:
    """Options that change how the model computes, not where it lives.

    ``activation_checkpointing``: checkpoint every n-th repeated block (None: off).
    ``recompute_attention``: the query-block size of memory-efficient attention (None: off).
    ``compile``: ``torch.compile`` each repeated block in place, and the loss
    (:mod:`llmlab.parallel.compile`).
    """

    activation_checkpointing: int | None = None
    recompute_attention: int | None = None
    compile: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | ModelTransforms | None) -> ModelTransforms:
        """Accept the config forms: ``{activation_checkpointing: n | {every: n} | true,
        recompute_attention: true | {block_size: n}, compile: bool}``; unknown keys are an
        error."""
        if isinstance(config, ModelTransforms):
            return config
        config = dict(config or {})
        valid = ("activation_checkpointing", "recompute_attention", "compile")
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise ValueError(f"unknown model transform(s) {unknown}; valid: {', '.join(valid)}")
        compile_ = config.get("compile") or False
        if not isinstance(compile_, bool):
            raise ValueError(f"compile must be true or false, got {compile_!r}")
        ac = config.get("activation_checkpointing")
        if isinstance(ac, Mapping):
            ac = ac.get("every", 1)
        elif ac is True:
            ac = 1
        elif ac is False:
            ac = None
        ra = config.get("recompute_attention")
        if isinstance(ra, Mapping):
            ra = ra.get("block_size", 128)
        elif ra is True:
            ra = 128
        elif ra is False:
            ra = None
        for name, value in (("activation_checkpointing", ac), ("recompute_attention", ra)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a bool, an int or a mapping, got {value!r}")
        return cls(activation_checkpointing=ac, recompute_attention=ra, compile=compile_)


@dataclass(frozen=True)
class Layout:
    """Where the model lives: the mesh's sizes and how the pipeline runs over it."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    boundaries: tuple[int, ...] | None = None


@dataclass
class ParallelModel:
    """What :func:`parallelize_model` produced on this rank."""

    model: nn.Module
    layout: Layout
    transforms: ModelTransforms
    params: list[nn.Parameter]  # the parameters this rank holds and trains, each once
    stage: StageModules | None = None  # this rank's pipeline chunks (pipeline > 1)
    tied: list[tuple[nn.Parameter, Any]] = field(default_factory=list)  # (copy, stage group)
    duplicates: list[nn.Parameter] = field(default_factory=list)  # tied copies owned elsewhere
    loss_fn: LossFn | None = None  # replaces the task's loss (vocab-parallel cross-entropy)
    applied: dict[str, Any] = field(default_factory=dict)  # what each step changed (for logs)

    @property
    def held_parameter_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def task_loss(self, loss_fn: LossFn) -> LossFn:
        """The loss the task must use from now on: the vocab-parallel one under tensor
        parallelism, else its own; compiled when the transforms say ``compile``."""
        loss = self.loss_fn or loss_fn
        if self.transforms.compile and not getattr(loss, "_llmlab_compiled", False):
            loss = compile_loss(loss)
            loss._llmlab_compiled = True  # type: ignore[attr-defined]
        return loss


def parallelize_model(
    model: nn.Module,
    layout: Layout | None = None,
    groups: ProcessGroups | None = None,
    transforms: ModelTransforms | None = None,
    convert_precision: Callable[[nn.Module], Any] | None = None,
    seed: int | None = None,
) -> ParallelModel:
    """Apply the layout and transforms to ``model`` in place, in the order above.

    ``groups``: this rank's process groups (``None`` for one process or a replicated layout:
    only the transforms apply). ``convert_precision``: the precision plugin's
    ``convert_module``. ``seed``: the tensor-parallel RNG seed (default ``torch.initial_seed()``).
    Calling it again on a model it already transformed returns the first result (Lightning sets
    a strategy up again for ``validate`` after ``fit``); a different layout is an error.
    """
    layout = layout or Layout()
    transforms = transforms or ModelTransforms()
    previous: ParallelModel | None = getattr(model, "_llmlab_parallel", None)
    if previous is not None:
        if (previous.layout, previous.transforms) != (layout, transforms):
            raise ValueError(
                f"this model was already parallelized as {previous.layout} with "
                f"{previous.transforms}; build a fresh model for {layout} with {transforms}"
            )
        return previous
    dims = layout.dims
    result = ParallelModel(model, layout, transforms, params=[])

    # 1-2. tensor (and sequence) parallelism: Megatron layers from the model's own plan
    if dims.tensor > 1:
        shardable = require(model, TensorParallelShardable, "tensor parallelism")
        assert groups is not None, "tensor parallelism needs process groups"
        parallelize(
            model,
            shardable.tensor_parallel_plan(),
            groups.tensor,
            sequence_parallel=layout.sequence_parallel,
            seed=torch.initial_seed() if seed is None else seed,
        )
        result.loss_fn = VocabParallelCrossEntropy(groups.tensor)
        result.applied["tensor_parallel"] = dims.tensor
    elif layout.sequence_parallel:
        raise ValueError("sequence_parallel=True needs tensor parallelism (tensor > 1)")

    # 3. memory: trade compute for activation memory
    if transforms.recompute_attention is not None:
        result.applied["recompute_attention"] = use_recompute_attention(
            model, block_size=transforms.recompute_attention
        )  # raises when the model's swap_attention changed no module
        log.info(
            "recompute attention (block %d): %d attention modules swapped",
            transforms.recompute_attention,
            result.applied["recompute_attention"],
        )
    if transforms.activation_checkpointing is not None:
        wrapped = apply_activation_checkpointing(model, every=transforms.activation_checkpointing)
        if not wrapped:
            raise ValueError(
                f"activation_checkpointing every={transforms.activation_checkpointing} wrapped "
                f"no block of {type(model).__name__}: every must be at most its number of blocks"
            )
        result.applied["activation_checkpointing"] = wrapped
        log.info("activation checkpointing: %d blocks wrapped (%s)", len(wrapped), wrapped)

    # 4. pipeline: keep this stage's layers, free the others'
    if dims.pipeline > 1:
        assert groups is not None, "pipeline parallelism needs process groups"
        pp = groups.coords[1]
        result.stage = cut_stage(
            pipeline_layers_of(model),
            dims.pipeline,
            pp,
            layout.virtual_stages,
            layout.boundaries,
        )
        pipelines = [
            [dims.rank_of(d, s, t) for s in range(dims.pipeline)]
            for d in range(dims.data)
            for t in range(dims.tensor)
        ]
        result.tied = build_tie_groups(result.stage, pipelines)
        result.duplicates = list(result.stage.duplicate_copies)
        prune_to_stage(model, result.stage.chunks)
        result.applied["pipeline_stage"] = (pp, result.stage.local_layers)

    # 5. precision: convert only what this rank keeps
    if convert_precision is not None:
        convert_precision(model)

    # 6. compile: block by block, in place (names and state-dict keys unchanged)
    if transforms.compile:
        if dims.tensor > 1:
            raise ValueError(COMPILE_WITH_TENSOR)
        result.applied["compile"] = compile_blocks(model)

    result.params = _unique_held_parameters(
        result.stage.chunks if result.stage is not None else [model]
    )
    model._llmlab_parallel = result  # type: ignore[assignment]
    return result


def check_layout(model: nn.Module, layout: Layout, global_batch: int | None = None) -> None:
    """Every check a layout needs that the model and config alone can answer, at once, with the
    numbers: tensor ∤ heads / KV heads / hidden / vocabulary, fewer pipeline layers than
    pipeline × virtual stages, a global batch not divisible by data × micro-batches.

    Cheap on a model built on the ``meta`` device, so the app runs it before any process starts.
    """
    dims = layout.dims
    problems: list[str] = []
    if dims.tensor > 1:
        shardable = require(model, TensorParallelShardable, "tensor parallelism")
        problems += tensor_parallel_problems(shardable.tensor_parallel_divisors(), dims.tensor)
    if dims.pipeline > 1:
        layers = len(pipeline_layers_of(model))
        parts = dims.pipeline * layout.virtual_stages
        if layers < parts:
            problems.append(
                f"the model has {layers} pipeline layers, fewer than pipeline ({dims.pipeline}) "
                f"× virtual stages ({layout.virtual_stages}) = {parts}"
            )
    if global_batch is not None:
        per_step = dims.data * layout.microbatches
        if global_batch % per_step:
            problems.append(
                f"global batch {global_batch} is not divisible by data ({dims.data}) × "
                f"microbatches ({layout.microbatches}) = {per_step}; use a multiple of {per_step}"
            )
    if layout.sequence_parallel and dims.tensor == 1:
        problems.append("sequence_parallel=True needs tensor > 1")
    if problems:
        raise ValueError("this layout cannot run: " + "; ".join(problems))


def _unique_held_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and not p.is_meta:
                seen.add(id(p))
                out.append(p)
    return out
