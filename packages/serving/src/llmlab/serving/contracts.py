"""What the serving engine needs from a model: one forward that takes an attention context.

(docs/architecture.md#contracts lists every contract of the repo.)

The consumer owns the contract; a model meets it structurally, without importing this package.
``llmlab.models.GPT`` and ``llmlab.models.Llama`` do, with the forward they train with:

* ``forward(input_ids, positions=, attention=, logits_to_keep=) -> logits``: the engine packs
  the new tokens of every scheduled sequence into one row, ``input_ids`` (1, N) with their own
  ``positions`` (1, N), and asks for the logits of a few rows only (``logits_to_keep``, a
  LongTensor of indices as in HF, or ``0`` when every row is wanted, as in a step of decodes).
  ``attention`` is the step's context (``llmlab.serving.model_runner.PagedAttention``, the
  protocol of ``llmlab.models.attention``): the forward calls ``begin(input_ids, positions,
  attention_mask)`` once, every attention layer ``attend(layer_idx, q, k, v, window=)`` in
  layer order with q (1, H, N, D) and k, v (1, H_kv, N, D), and ``end(N)`` once. The context
  writes k and v to the KV pool and attends through the block tables.
* ``config.block_size`` (the longest sequence the model takes) and ``config.vocab_size``;
  ``parameters()`` (where the model lives, as any ``nn.Module``).

Nothing else of the model is read, and nothing of it is changed: the KV pool's per-layer shapes
(KV heads, head dim, dtype, sliding window) are learned from one probing forward of a single
token.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


class ModelConfig(Protocol):
    block_size: int
    vocab_size: int


@runtime_checkable
class PagedModel(Protocol):
    config: ModelConfig

    def __call__(
        self, input_ids: Tensor, *, positions: Tensor, attention: Any, logits_to_keep: Tensor | int
    ) -> Tensor: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


def _takes(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_paged_model(model: Any) -> None:
    """Refuse, naming what is missing, a model that does not meet :class:`PagedModel`."""
    missing = [] if callable(getattr(model, "parameters", None)) else ["parameters"]
    forward = getattr(model, "forward", model)
    missing += [f"forward({n}=)" for n in ("positions", "attention", "logits_to_keep")
                if not _takes(forward, n)]  # fmt: skip
    config = getattr(model, "config", None)
    missing += [
        f"config.{k}"
        for k in ("block_size", "vocab_size")
        if not isinstance(getattr(config, k, None), int)
    ]
    if missing or not callable(model):
        raise TypeError(
            f"{type(model).__name__} does not meet llmlab.serving's model contract "
            f"(missing: {', '.join(missing) or '__call__'}); llmlab.models.GPT and Llama do"
        )
