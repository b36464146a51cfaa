"""``parallelize_model``: how a plain model becomes parallel, on one screen.

torchtitan's ``parallelize_llama`` is the example: the model is written for one device, and every
transformation is applied from outside, here, in one stated order. Strategies call this function;
tasks and the app never transform a model.

    1. expert parallelism      this rank's slice of each MoE layer's experts, all-to-all around it
    2. tensor parallelism      shard the layers the model's ``tensor_parallel_plan()`` names
    2b. sequence parallelism   norms / dropout / residual adds on sequence shards (part of 2)
    2c. context parallelism    ring attention over the context group, global position ids
    3. memory                  recompute attention, activation checkpointing of repeated blocks
    4. pipeline stage split    keep this stage's ``pipeline_layers()``, free the rest
       pretrained weights      a ``meta`` model is filled: this stage's layers, this TP slice
    5. precision               the precision plugin converts what is left
    6. compile                 each repeated block compiled in place (``compile=true``)
    7. data parallel / ZeRO    the strategy's gradient reducer, built from ``ParallelModel.params``

Why this order: the expert slices come first, so that the gradient hooks sequence parallelism
puts on every replicated parameter (a MoE layer's router and routed experts are replicated over
the tensor group) land on the slices this rank keeps; sharding swaps ``nn.Linear`` modules, so
it comes before anything that wraps blocks (a checkpoint wrapper would hide them); the pipeline
cut comes after both so that every stage holds already-sharded, already-wrapped layers and a
tied weight stays one object; precision converts only what this rank keeps, so fp32 master
weights are the shards the optimizer holds.
Pretrained weights (``weights``) are read after the cut and before precision: only what this rank
keeps is read (:mod:`llmlab.parallel.checkpoint.pretrained`), and the masters are made from them.

The model meets the contracts in :mod:`llmlab.parallel.contracts` structurally; nothing here
knows a model class.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.parallel.compile import compile_blocks, compile_loss
from llmlab.parallel.context.group import ContextParallel
from llmlab.parallel.context.step import check_context
from llmlab.parallel.contracts import (
    TensorParallelShardable,
    WeightSource,
    require,
)
from llmlab.parallel.expert import ExpertParallel
from llmlab.parallel.memory import apply_activation_checkpointing, use_recompute_attention
from llmlab.parallel.mesh import ParallelDims, ProcessGroups, check_layout
from llmlab.parallel.pipeline.schedules import placement
from llmlab.parallel.pipeline.split_layout import prepare_chunks
from llmlab.parallel.pipeline.stage import (
    StageModules,
    build_tie_groups,
    cut_stage,
    pipeline_layers_of,
    prune_to_stage,
)
from llmlab.parallel.tensor.cross_entropy import VocabParallelCrossEntropy
from llmlab.parallel.tensor.sharding import parallelize
from llmlab.parallel.transforms import ModelTransforms

LossFn = Callable[[Tensor, Tensor], Tensor]
log = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """What :func:`parallelize_model` produced on this rank."""

    model: nn.Module
    dims: ParallelDims
    transforms: ModelTransforms
    params: list[nn.Parameter]  # the parameters this rank holds and trains, each once
    stage: StageModules | None = None  # this rank's pipeline chunks (pipeline > 1)
    tied: list[tuple[nn.Parameter, Any]] = field(default_factory=list)  # (copy, stage group)
    duplicates: list[nn.Parameter] = field(default_factory=list)  # tied copies owned elsewhere
    loss_fn: LossFn | None = None  # replaces the task's loss (vocab-parallel cross-entropy)
    context: ContextParallel | None = None  # ring attention (context > 1), split in steps only
    expert: ExpertParallel | None = None  # expert parallelism (expert > 1): the expert slices
    applied: dict[str, Any] = field(default_factory=dict)  # what each step changed (for logs)

    @property
    def held_parameter_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def task_loss(self, loss_fn: LossFn) -> LossFn:
        """The loss the task must use from now on: the vocab-parallel one under tensor
        parallelism, else its own; compiled when the transforms say ``compile``. It stays this
        rank's mean over its tokens (also a context rank's part of each sequence): the task
        weighs it into the global batch's mean (:mod:`llmlab.parallel.loss_mean`)."""
        loss = self.loss_fn or loss_fn
        if self.transforms.compile and self.loss_fn is None and loss not in _COMPILED_LOSSES:
            loss = compile_loss(loss)
            _COMPILED_LOSSES.add(loss)
        return loss


# What parallelize_model did to each model (Lightning sets a strategy up again for validate after
# fit: the second call returns the first result), and the losses it compiled, held
# weakly so that neither outlives its object and nothing is written onto objects this module
# does not own.
_PARALLELIZED: weakref.WeakKeyDictionary[nn.Module, ParallelModel] = weakref.WeakKeyDictionary()
_COMPILED_LOSSES: weakref.WeakSet[Any] = weakref.WeakSet()


def parallelize_model(
    model: nn.Module,
    dims: ParallelDims | None = None,
    groups: ProcessGroups | None = None,
    transforms: ModelTransforms | None = None,
    convert_precision: Callable[[nn.Module], Any] | None = None,
    seed: int | None = None,
    global_batch: int | None = None,
    weights: WeightSource | None = None,
) -> ParallelModel:
    """Apply the layout and transforms to ``model`` in place, in the order above.

    ``dims``: the layout (``None``: one process). ``groups``: this rank's process groups
    (``None`` for one process or a replicated layout: only the transforms apply); with them the
    layout is first checked against the world, the model and ``global_batch`` by
    :func:`~llmlab.parallel.mesh.check_layout` (the message a strategy or the app would give).
    ``convert_precision``: the precision plugin's ``convert_module``. ``seed``: the
    tensor-parallel RNG seed (default ``torch.initial_seed()``). Calling it again on a model it
    already transformed returns the first result (Lightning sets a strategy up again for
    ``validate`` after ``fit``); a different layout is an error.
    """
    dims = dims or ParallelDims()
    if groups is not None:  # the world first: the groups were built for it
        dims = dims.resolve(groups.dims.world_size)
    transforms = transforms or ModelTransforms()
    previous = _PARALLELIZED.get(model)
    if previous is not None:
        if (previous.dims, previous.transforms) != (dims, transforms):
            raise ValueError(
                f"this model was already parallelized as {previous.dims} with "
                f"{previous.transforms}; build a fresh model for {dims} with {transforms}"
            )
        return previous
    if groups is not None:
        check_layout(dims, model=model, global_batch=global_batch)
    result = ParallelModel(model, dims, transforms, params=[])

    # 1. expert parallelism: a slice of every MoE layer's experts, tokens sent by all-to-all.
    # First, so that what later steps attach to parameters (sequence parallelism's gradient
    # hooks) lands on the slices this rank keeps, not on the full stacks it replaces.
    if dims.expert > 1:
        assert groups is not None, "expert parallelism needs process groups"
        index = dims.expert_coords(groups.rank)[1]
        result.expert = ExpertParallel(groups.expert, dims.expert, index)
        result.applied["expert_parallel"] = result.expert.apply(model)  # raises: no MoE layer

    # 2. tensor (and sequence) parallelism: Megatron layers from the model's own plan
    if dims.tensor > 1:
        shardable = require(model, TensorParallelShardable, "tensor parallelism")
        assert groups is not None, "tensor parallelism needs process groups"
        parallelize(
            model,
            shardable.tensor_parallel_plan(),
            groups.tensor,
            sequence_parallel=dims.sequence_parallel,
            seed=torch.initial_seed() if seed is None else seed,
        )
        result.loss_fn = VocabParallelCrossEntropy(groups.tensor)
        result.applied["tensor_parallel"] = dims.tensor

    # 2c. context parallelism: ring attention; the strategy splits its steps (``split_batch``)
    if dims.context > 1:
        assert groups is not None, "context parallelism needs process groups"
        check_context(dims.context, transforms)
        result.context = ContextParallel(groups.context)
        result.applied["context_parallel"] = result.context.apply(model, active=False)

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
        pp = groups.coords.pipeline
        result.stage = cut_stage(
            pipeline_layers_of(model), dims.pipeline, pp, dims.virtual_stages, dims.boundaries,
            placement=placement(dims.schedule),
        )  # fmt: skip
        if prepare_chunks(dims.schedule, result.stage.chunks):  # B and W share one recompute
            result.applied["shared_recompute"] = True
        pipelines = [dims.pipeline_ranks(c) for c in map(dims.coords, range(dims.world_size))
                     if c.pipeline == 0]  # fmt: skip
        tied = build_tie_groups(result.stage, pipelines)  # a frozen tie (LoRA) has no gradient
        result.tied = [(p, group) for p, group in tied if p.requires_grad]
        result.duplicates = list(result.stage.duplicate_copies)
        prune_to_stage(model, result.stage.chunks)
        result.applied["pipeline_stage"] = (pp, result.stage.local_layers)

    # 4b. pretrained weights: what this rank keeps, and only that, read into the meta model
    if weights is not None:
        # (imported here: the checkpoint package imports the data strategies, which import this)
        from llmlab.parallel.checkpoint.pretrained import load_pretrained, log_weights_read

        held = result.stage.chunks if result.stage is not None else [model]
        coords = groups.coords if groups is not None else None
        report = load_pretrained(model, weights, held, coords.tensor if coords else 0, dims.tensor)
        log_weights_read(report, f"at {coords}" if coords else "")
        result.applied["init_from"] = report

    # 5. precision: convert only what this rank keeps
    if convert_precision is not None:
        convert_precision(model)

    # 6. compile: block by block, in place (names and state-dict keys unchanged)
    if transforms.compile:
        result.applied["compile"] = compile_blocks(model)

    result.params = _unique_held_parameters(
        result.stage.chunks if result.stage is not None else [model]
    )
    _PARALLELIZED[model] = result
    return result


def hand_transforms(
    strategy: Any,
    module: Any,
    transforms: ModelTransforms | Mapping[str, Any] | None,
    model_attribute: str = "model",
) -> None:
    """Make sure ``transforms`` reach ``module.<model_attribute>``, exactly once.

    A strategy that applies them itself with its layout (the N-D strategy and its presets) takes
    them at construction and holds them as ``strategy.transforms``: they must be these (given
    twice, or differently, is an error). Any other strategy (one process, DDP, bucketed,
    parameter server, DeepSpeed) trains a replicated model, so ``parallelize_model`` runs here
    with no layout and applies only the transforms, and the task's loss becomes the one it
    returns (compiled, with ``compile``).
    """
    transforms = ModelTransforms.from_config(transforms)
    held = getattr(strategy, "transforms", None)
    if isinstance(held, ModelTransforms):
        if held != transforms:
            raise ValueError(
                f"{type(strategy).__name__} was built with transforms {held}, not {transforms}; "
                "give them to the strategy at construction (transforms=...), once"
            )
        return
    model = getattr(module, model_attribute)
    module.loss_fn = parallelize_model(model, transforms=transforms).task_loss(module.loss_fn)


def _unique_held_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for p in module.parameters():  # a frozen base (LoRA) is held but neither reduced,
            if id(p) not in seen and not p.is_meta and p.requires_grad:  # sharded nor stepped
                seen.add(id(p))
                out.append(p)
    return out
