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
* :class:`HasFlops` -- ``flops_per_token()``: training FLOPs per token of the *whole* model (read
  before any sharding, for MFU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

# (q, k, v, causal: bool = True, dropout_p: float = 0.0, *, document_ids: Tensor | None = None)
AttentionFn = Callable[..., Tensor]


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
class HasFlops(Protocol):
    def flops_per_token(self) -> float: ...


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
