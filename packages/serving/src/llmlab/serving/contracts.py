"""What the serving engine needs from a model: the paged-attention contract.

(docs/architecture.md#contracts lists every contract of the repo.)

The consumer owns the contract; a model meets it structurally, without importing this package.
``llmlab.models.GPT`` and ``llmlab.models.Llama`` do, through doors they already have:

* ``forward(input_ids, positions=, logits_to_keep=) -> logits``: the engine packs the new
  tokens of every scheduled sequence into one row, ``input_ids`` (1, N) with their own
  ``positions`` (1, N), and asks for the logits of a few rows only (``logits_to_keep``, a
  LongTensor of indices as in HF, or ``0`` when every row is wanted, as in a step of decodes).
  Without a cache or a mask, every attention layer calls its attention function on the packed
  tokens as if they were one causal sequence.
* ``swap_attention(wrap) -> int``: replaces each layer's attention function ``fn(q, k, v,
  causal=True, dropout_p=0.0)`` (q (B, H, T, D), k and v (B, H_kv, T, D)) by ``wrap(fn)``, in
  layer order, and returns how many layers it wrapped. The engine's wrapper writes k and v to
  the KV pool and attends through the block tables; outside the engine's forward it calls
  ``fn`` unchanged, so the model keeps working as before everywhere else.
* ``config.block_size`` (the longest sequence the model takes) and ``config.vocab_size``;
  ``parameters()`` (where the model lives, as any ``nn.Module``).

Optional, for the engine's hot path: ``inference_forward(input_ids, positions=,
logits_to_keep=)``, the same logits as ``__call__`` bit for bit without ``nn.Module`` dispatch,
and ``inference_forward_applies()``, whether that holds for the model's current layers
(``llmlab.models.GPT`` has both); the runner uses it when it applies at construction, in eval
mode, while no forward hook is set. If ``inference_forward`` takes ``linear=`` (a function
``(x, module) -> x @ module.weight.T + module.bias`` for each ``nn.Linear``), the runner passes
its own on a CPU (``llmlab.serving.linear``: oneDNN for products of two rows or more).
``native_decode_step(keys, values) -> step | None`` (GPT and Llama: ``llmlab.models.native``): one
token's whole forward as one call ``step(token, position, block_table) -> logits (1, 1, V)``
over the runner's per-layer pools (num_blocks, block_size, H_kv, D): write the token's key and
value at its slot, attend over its sequence's keys through the block table; equal to the Python
step to fp32 rounding. The runner uses it on a CPU for every step of one one-token chunk, under
the conditions the lean forward has (eval mode, no hook; the model's own method checks its
layers) and ``EngineConfig.native_step``, whatever the ``attention_backend`` (it is its own
attention).

Nothing else of the model is read: the KV pool's per-layer shapes (KV heads, head dim, dtype)
are learned from one probing forward of a single token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


class ModelConfig(Protocol):
    block_size: int
    vocab_size: int


AttentionFn = Callable[..., Tensor]


@runtime_checkable
class PagedModel(Protocol):
    config: ModelConfig

    def __call__(
        self, input_ids: Tensor, *, positions: Tensor, logits_to_keep: Tensor | int
    ) -> Tensor: ...

    def swap_attention(self, wrap: Callable[[AttentionFn], AttentionFn]) -> int: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


def check_paged_model(model: Any) -> None:
    """Refuse, naming what is missing, a model that does not meet :class:`PagedModel`."""
    missing = [n for n in ("swap_attention", "parameters") if not callable(getattr(model, n, None))]
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
