"""``parallelize(model, plan, group)``: apply a tensor-parallel plan to a plain model, from outside.

The model only states *what* to shard (``tensor_parallel_plan()``: module-name patterns to
``"colwise"``, ``"rowwise"``, ``"vocab"`` or ``"replicate"``); this function swaps the matching
modules for Megatron-style layers built by slicing their full weights, so the model's own code is
untouched. Tied weights stay tied: a weight shared by several modules is sliced once and the same
shard is shared.

With ``sequence_parallel=True`` the activations between tensor-parallel regions (LayerNorms,
dropout, residual adds) live in sequence shards (B, T/tp, d):

* the vocab embedding reduce-scatters along the sequence instead of all-reducing, and any other
  embedding beside it (the position table) hands on only this rank's chunk of its output;
* column-parallel layers all-gather their input along the sequence, row-parallel layers
  reduce-scatter their output (the vocab-parallel head thus gathers the final LayerNorm output);
* every replicated parameter after the embedding sees only a sequence shard, so its gradient is
  all-reduced over the tensor-parallel group (a gradient hook, so a plain training loop works);
* dropout draws from the per-rank stream (``TensorParallelRNG``), as it does inside attention.

A planned linear layer that carries low-rank adapters (LoRA, :class:`LowRankAdapted`) keeps its
wrapper: its base is sharded by the plan's style and the adapter with it, so ``y = W x + s·B A x``
is computed exactly as in one process. Column-parallel base: ``A`` replicated, ``B`` split by
output rows (a ``ColumnParallelLinear`` on the rank-``r`` activation: its input mapping sums
that activation's partial gradients over the group, so ``A``'s is whole); row-parallel base:
``A`` split by input columns (a ``RowParallelLinear``: the rank-``r`` partial sum is reduced,
``r`` numbers per token, not the layer's width), ``B`` replicated. Under sequence parallelism
the replicated half sees a sequence shard and joins the gradient all-reduce below, like a norm
weight. A vocab-parallel layer (the LM head) with adapters is refused.

Divisibility is checked for the whole plan before any module is touched, with a message that
names the numbers: the model's own ``tensor_parallel_divisors()`` (heads, KV heads, hidden size,
vocabulary) and every sharded layer's dimension.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from llmlab.parallel.contracts import (
    AttentionSwappable,
    LowRankAdapted,
    TensorParallelShardable,
    tensor_parallel_problems,
)
from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.layers import (
    REGION_PARTIAL_ATTR,
    SEQUENCE_PARALLEL_ATTR,
    SHARD_DIM_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from llmlab.parallel.tensor.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    scatter_to_sequence_region,
)
from llmlab.parallel.tensor.primitives import Group
from llmlab.parallel.tensor.random import ForkedRNG, TensorParallelRNG, forked

STYLES = ("colwise", "rowwise", "vocab", "replicate")


@dataclass
class TensorParallelInfo:
    """What ``parallelize`` did, kept on the model as ``model.tensor_parallel``."""

    group: Group = field(repr=False)
    size: int
    rank: int
    sequence_parallel: bool
    plan: dict[str, str]
    rng: TensorParallelRNG = field(repr=False)
    styles: dict[str, str] = field(default_factory=dict)  # module name -> applied style


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style for every module matched by a plan pattern (``*`` is a wildcard)."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; valid: {list(STYLES)}")
        matches = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in matches:
            resolved[name] = style
    return resolved


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), parent_name, child


def validate_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """Check every divisibility the plan needs at tensor-parallel size ``tp``; return the plan
    resolved to module names. Raises ``ValueError`` naming the module and the numbers."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    resolved = resolve_plan(model, plan)
    problems: list[str] = []
    if isinstance(model, TensorParallelShardable):  # whole heads, KV heads, vocab: by name
        problems += tensor_parallel_problems(model.tensor_parallel_divisors(), tp)
    for name, style in resolved.items():
        module = _base_of(model.get_submodule(name), name, style)
        if style == "colwise":
            if not isinstance(module, nn.Linear):
                raise TypeError(
                    f"{name}: 'colwise' needs an nn.Linear, got {type(module).__name__}"
                )
            if module.out_features % tp:
                problems.append(
                    f"{name}: out_features={module.out_features} (hidden size) is not divisible "
                    f"by tensor-parallel size {tp}"
                )
        elif style == "rowwise":
            if not isinstance(module, nn.Linear):
                raise TypeError(
                    f"{name}: 'rowwise' needs an nn.Linear, got {type(module).__name__}"
                )
            if module.in_features % tp:
                problems.append(
                    f"{name}: in_features={module.in_features} (hidden size) is not divisible by "
                    f"tensor-parallel size {tp}"
                )
        elif style == "vocab":
            if isinstance(module, nn.Embedding):
                vocab = module.num_embeddings
            elif isinstance(module, nn.Linear):
                vocab = module.out_features
            else:
                raise TypeError(
                    f"{name}: 'vocab' needs an nn.Embedding or nn.Linear, "
                    f"got {type(module).__name__}"
                )
            if vocab % tp:
                problems.append(
                    f"{name}: vocabulary size {vocab} is not divisible by tensor-parallel size {tp}"
                )
    if problems:
        raise ValueError("tensor parallelism cannot shard this model:\n  " + "\n  ".join(problems))
    return resolved


def parallelize(
    model: nn.Module,
    plan: dict[str, str],
    group: Group,
    sequence_parallel: bool = False,
    seed: int | None = None,
) -> nn.Module:
    """Shard ``model`` in place across ``group`` following ``plan``; returns the model.

    Call on every rank of ``group`` with identical full weights. ``seed`` seeds the per-rank
    dropout stream (default: ``torch.initial_seed()``, the same on every rank when seeded alike).
    The forward returns vocabulary-sharded logits when the head is ``"vocab"``: pair it with
    :func:`vocab_parallel_cross_entropy`, or ``gather_from_tensor_region`` for full logits.
    """
    tp, rank = C.group_size(group), C.group_rank(group)
    resolved = validate_plan(model, plan, tp)
    rng = TensorParallelRNG(torch.initial_seed() if seed is None else seed, rank)
    info = TensorParallelInfo(group, tp, rank, sequence_parallel, dict(plan), rng, resolved)

    # Parents holding both a column- and a row-parallel child enclose a whole tensor-parallel
    # region (attention, MLP): their input enters it once, at the parent's entry (module doc).
    region_parents = _region_parents(resolved)
    # id(full weight) -> (full weight, its shard), so ties survive; holding the full weight keeps
    # its id from being reused while the loop runs.
    shards: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    entry_modules: list[str] = []  # parents of vocab embeddings: where the model's input enters
    for name, style in resolved.items():
        module = model.get_submodule(name)
        parent, parent_name, child = _parent(model, name)
        if style == "replicate":
            continue
        if isinstance(module, LowRankAdapted):  # LoRA: the base and its adapter, each sharded
            entered = parent_name in region_parents
            _shard_adapted(module, style, group, sequence_parallel, name, entered)
            continue
        full_weight = module.weight
        shared = shards[id(full_weight)][1] if id(full_weight) in shards else None
        if style == "colwise":
            new: nn.Module = ColumnParallelLinear(
                module,
                group,
                sequence_parallel=sequence_parallel,
                weight=shared,
                name=name,
                input_in_region=parent_name in region_parents,
            )
        elif style == "rowwise":
            new = RowParallelLinear(module, group, sequence_parallel=sequence_parallel, name=name)
        elif isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding(
                module, group, sequence_parallel=sequence_parallel, weight=shared, name=name
            )
            entry_modules.append(parent_name)
        else:  # a vocab-parallel head: column-parallel, logits stay sharded for the loss
            new = ColumnParallelLinear(
                module, group, sequence_parallel=sequence_parallel, weight=shared, name=name
            )
        shards.setdefault(id(full_weight), (full_weight, new.weight))
        setattr(parent, child, new)

    for parent_name in region_parents:
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_forward_pre_hook(_enter_region(group, sequence_parallel))
    _fork_attention_dropout(model, rng)
    if sequence_parallel:
        _apply_sequence_parallel(model, resolved, entry_modules, group, rng)
    else:
        _reduce_region_partials(model, resolved, region_parents, group)
    model.tensor_parallel = info
    return model


def _base_of(module: nn.Module, name: str, style: str) -> nn.Module:
    """The linear layer a plan style applies to: the module, or a LoRA layer's base (which
    must be a float ``nn.Linear``: a quantized base has no weight to slice)."""
    if not isinstance(module, LowRankAdapted) or style == "replicate":
        return module
    if style == "vocab":
        raise TypeError(
            f"{name}: LoRA on a vocab-parallel layer (the LM head, the embedding) is not "
            "tensor-parallel; leave it out of lora.target_modules (the presets do)"
        )
    if not isinstance(module.base_layer, nn.Linear):
        raise TypeError(
            f"{name}: {style!r} shards a LoRA layer's nn.Linear base, got "
            f"{type(module.base_layer).__name__} (a quantized base is not tensor-parallel)"
        )
    return module.base_layer


def _shard_adapted(
    module: nn.Module,
    style: str,
    group: Group,
    sequence_parallel: bool,
    name: str,
    input_in_region: bool,
) -> None:
    """Shard a LoRA layer in place (module docstring): the base by ``style``, and ``lora_B``
    (column) or ``lora_A`` (row) with it; the other adapter matrix stays whole."""
    base, lora_a, lora_b = module.base_layer, module.lora_A, module.lora_B
    out_features, in_features = base.weight.shape
    if (lora_b.out_features, lora_a.in_features) != (out_features, in_features):
        raise ValueError(
            f"{name}: the LoRA matrices do not fit the base {(out_features, in_features)}"
        )
    if style == "colwise":
        module.base_layer = ColumnParallelLinear(
            base, group, sequence_parallel=sequence_parallel, name=name,
            input_in_region=input_in_region,
        )  # fmt: skip
        module.lora_B = ColumnParallelLinear(
            lora_b, group, sequence_parallel=sequence_parallel, name=f"{name}.lora_B",
            input_in_region=input_in_region,
        )  # fmt: skip
    elif style == "rowwise":
        module.base_layer = RowParallelLinear(base, group, sequence_parallel, name=name)
        module.lora_A = RowParallelLinear(lora_a, group, sequence_parallel, f"{name}.lora_A")
    else:
        raise TypeError(f"{name}: a LoRA layer is sharded 'colwise' or 'rowwise', not {style!r}")


def _region_parents(resolved: dict[str, str]) -> set[str]:
    styles_by_parent: dict[str, set[str]] = {}
    for name, style in resolved.items():
        styles_by_parent.setdefault(name.rpartition(".")[0], set()).add(style)
    return {p for p, styles in styles_by_parent.items() if {"colwise", "rowwise"} <= styles}


def _enter_region(group: Group, sequence_parallel: bool):
    """The region's entry: its input all-gathered along the sequence (SP) or copied, the
    backward summing every rank's partial gradient of it."""
    enter = gather_from_sequence_region if sequence_parallel else copy_to_tensor_region

    @torch.compiler.disable  # a collective: kept out of compiled graphs (like the mappings)
    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (enter(args[0], group), *args[1:])

    return hook


def _reduce_region_partials(
    model: nn.Module, resolved: dict[str, str], region_parents: set[str], group: Group
) -> None:
    """Without SP: a replicated parameter inside a region, before its row-parallel layer,
    feeds only this rank's heads (a q/k norm; latent attention's down-projections and their
    norms), so its gradient is this rank's part of the sum: all-reduced over the group, like a
    norm weight under SP. What the row-parallel layers hold (their bias, a LoRA ``B`` beside
    them) sees the summed output and is whole already."""
    after_sum = {
        id(p)
        for name, style in resolved.items()
        if style == "rowwise"
        for p in model.get_submodule(name).parameters()
    }
    for parent_name in region_parents:
        parent = model.get_submodule(parent_name) if parent_name else model
        for p in parent.parameters():
            if hasattr(p, SHARD_DIM_ATTR) or id(p) in after_sum or not p.requires_grad:
                continue
            if getattr(p, REGION_PARTIAL_ATTR, False):
                continue  # shared by two regions: one hook
            setattr(p, REGION_PARTIAL_ATTR, True)
            p.register_hook(lambda g: C.all_reduce(g, group, "tensor_region.grad"))


def _fork_attention_dropout(model: nn.Module, rng: TensorParallelRNG) -> None:
    """Attention's dropout acts on this rank's heads: run it under the per-rank stream."""
    if isinstance(model, AttentionSwappable):
        model.swap_attention(lambda attention: forked(attention, rng))


def _apply_sequence_parallel(
    model: nn.Module,
    resolved: dict[str, str],
    entry_modules: list[str],
    group: Group,
    rng: TensorParallelRNG,
) -> None:
    if not entry_modules:
        raise ValueError(
            "sequence_parallel=True needs a 'vocab' embedding in the plan: it is where the "
            "sequence is split"
        )
    sharded_names = set(resolved)
    # Siblings of the vocab embedding (the position table) produce full-sequence outputs: keep
    # this rank's chunk; the gradient is all-gathered, so their weights' gradients are complete.
    for parent_name in entry_modules:
        parent = model.get_submodule(parent_name) if parent_name else model
        for child_name, child in parent.named_children():
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Embedding) and full_name not in sharded_names:
                child.register_forward_hook(
                    lambda _m, _args, out: scatter_to_sequence_region(out, group)
                )
    entry_params = set()
    for parent_name in entry_modules:
        parent = model.get_submodule(parent_name) if parent_name else model
        entry_params.update(id(p) for p in parent.parameters())
    for p in model.parameters():
        if hasattr(p, SHARD_DIM_ATTR) or id(p) in entry_params or not p.requires_grad:
            continue
        setattr(p, SEQUENCE_PARALLEL_ATTR, True)
        p.register_hook(lambda g: C.all_reduce(g, group, "sequence_parallel.grad"))
    # Every dropout now sees a sequence shard (or a head shard): per-rank streams.
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, child_name, ForkedRNG(child, rng))
        del name


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradients ``parallelize`` all-reduces over the TP group."""
    return [p for p in model.parameters() if getattr(p, SEQUENCE_PARALLEL_ATTR, False)]
