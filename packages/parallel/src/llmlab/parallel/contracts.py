"""What ``llmlab.parallel`` needs from a model, declared here (the consumer owns the contract).

Models meet these structurally -- ``llmlab.models`` never imports this module, and nothing in
``llmlab.parallel`` reads a model attribute that is not named below or checks a concrete class.
Each transform asks only for the door it uses, so a model that cannot be tensor-parallel (ResNet-50)
still pipelines, and a clear error names the missing method when a layout needs it.

* :class:`PipelineSplittable` -- ``pipeline_layers()``: the ordered one-tensor-to-one-tensor layers
  whose composition is the forward (GPT: embedding, blocks..., final norm + head).
* :class:`TensorParallelShardable` -- ``tensor_parallel_plan()``: module-name patterns to a style
  (``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"replicate"``), and
  ``tensor_parallel_divisors()``: the sizes the tensor degree must divide, by a name a user
  recognises (``{"n_head": 4, "n_kv_head": 2, "n_embd": 128, "vocab_size": 256}``), so a bad
  layout fails before any process starts, naming the numbers.
* :class:`HasRepeatedBlocks` -- ``repeated_blocks()``: the model's repeated units (transformer
  blocks, ResNet bottlenecks). Activation checkpointing wraps them, ``compile`` compiles them one
  by one, ZeRO-3 gathers their parameters one block at a time.
* :class:`AttentionSwappable` -- ``swap_attention(wrap)``: replace every attention function
  ``fn`` by ``wrap(fn)`` (same signature as ``torch.nn.functional.scaled_dot_product_attention``
  restricted to ``(q, k, v, causal, dropout_p)``, plus ``document_ids`` by keyword when the
  batch packs several documents per row); returns how many modules changed. Recompute
  attention, tensor parallelism's per-rank dropout stream and context parallelism's ring
  attention go through it.
* :class:`ExpertParallelizable` -- a mixture-of-experts *layer* (found among the model's
  modules, whatever its class): ``expert_parameters()``, its routed experts' stacked weights
  ``(E, ...)`` by name under the layer, and ``swap_experts(wrap)``: replace its expert
  computation ``fn(x, counts) -> y`` (``x``: the rows sorted by expert, ``counts`` (E,) rows per
  expert; ``y``: each row through its expert) by ``wrap(fn)``; returns how many layers changed.
  Expert parallelism keeps a slice of the experts per rank and wraps ``fn`` in its all-to-all
  dispatch and combine (:mod:`llmlab.parallel.expert`).
* :class:`LowRankAdapted` -- a linear *layer* with low-rank adapters beside it (LoRA:
  ``base_layer(x) + s · lora_B(lora_A(x))``, found among the model's modules, whatever its
  class): ``base_layer``, ``lora_A`` and ``lora_B`` are linear modules. Tensor parallelism shards
  the base by its plan style and the adapter with it (column: ``lora_B`` by output rows; row:
  ``lora_A`` by input columns); pretrained weights name the base as the layer itself (peft's
  convention: ``q_proj.base_layer.weight`` is read as ``q_proj.weight``).
* :class:`HasFlops` -- ``flops_per_token()``: training FLOPs per token of the *whole* model (read
  before any sharding, for MFU).
* :class:`WeightSource` -- ``read(name, part)``: a tensor of the unsplit model by state-dict key,
  whole or ``part = (dim, index, count)`` (``chunk(count, dim)[index]``), reading only that;
  ``bytes_read`` and ``total_bytes(names)``. A model built on ``meta`` is filled from one after
  its layout is applied (``model.init_from``: ``llmlab.models.hf.PretrainedWeights``).
* :class:`HoldsPretrainedWeights` -- ``take_pretrained_weights()``: a LightningModule whose
  model is still on ``meta`` hands over its :class:`WeightSource` (once; ``None`` after), so a
  strategy that knows the layout reads each rank's part instead of the module reading it whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

# (q, k, v, causal: bool = True, dropout_p: float = 0.0, *, document_ids: Tensor | None = None)
AttentionFn = Callable[..., Tensor]
# (x: rows sorted by expert (M, C), counts: (E,) rows per expert) -> (M, C)
ExpertFn = Callable[[Tensor, Tensor], Tensor]


@runtime_checkable
class PipelineSplittable(Protocol):
    def pipeline_layers(self) -> list[nn.Module]: ...


@runtime_checkable
class TensorParallelShardable(Protocol):
    def tensor_parallel_plan(self) -> dict[str, str]: ...

    def tensor_parallel_divisors(self) -> dict[str, int]: ...


@runtime_checkable
class HasRepeatedBlocks(Protocol):
    def repeated_blocks(self) -> list[nn.Module]: ...


@runtime_checkable
class AttentionSwappable(Protocol):
    def swap_attention(self, wrap: Callable[[AttentionFn], AttentionFn]) -> int: ...


@runtime_checkable
class ExpertParallelizable(Protocol):
    def expert_parameters(self) -> dict[str, nn.Parameter]: ...

    def swap_experts(self, wrap: Callable[[ExpertFn], ExpertFn]) -> int: ...


@runtime_checkable
class LowRankAdapted(Protocol):
    base_layer: nn.Module
    lora_A: nn.Module
    lora_B: nn.Module


@runtime_checkable
class HasFlops(Protocol):
    def flops_per_token(self) -> float: ...


@runtime_checkable
class WeightSource(Protocol):
    bytes_read: int

    def read(self, name: str, part: tuple[int, int, int] | None = None) -> Tensor: ...

    def total_bytes(self, names: Iterable[str] | None = None) -> int: ...


@runtime_checkable
class HoldsPretrainedWeights(Protocol):
    def take_pretrained_weights(self) -> WeightSource | None: ...


def require(model: Any, contract: type, why: str) -> Any:
    """``model`` if it meets ``contract``; otherwise a ``TypeError`` naming the missing methods."""
    if isinstance(model, contract):
        return model
    methods = [
        name
        for name, value in vars(contract).items()
        if callable(value) and not name.startswith("_") and not callable(getattr(model, name, None))
    ]
    raise TypeError(
        f"{type(model).__name__} cannot be used for {why}: it has no {', '.join(methods)}() "
        f"(the {contract.__name__} contract in llmlab.parallel.contracts)"
    )


def tensor_parallel_problems(divisors: dict[str, int], tensor: int) -> list[str]:
    """Each size in ``divisors`` the tensor-parallel degree does not divide, as a message."""
    return [
        f"{name}={value} is not divisible by tensor={tensor}"
        for name, value in divisors.items()
        if value % tensor
    ]
