"""Many LoRA adapters over one base in one batch: the layer a serving engine puts on the model.

One served batch mixes requests for different adapters (and the base). Each targeted linear
layer becomes a :class:`MultiLoRALinear` holding every adapter's ``A`` and ``B`` stacked by
*slot*, ranks padded to the largest (zeros), and a slot an adapter does not target left at
rank 0; per slot it keeps its rank and scale (``α/r``, rsLoRA ``α/√r``). For token ``t``
served by slot ``s``::

    y_t = W x_t + s_s · B_s A_s x_t          (slot -1, the base: y_t = W x_t)

**How a layer learns each token's slot.** The model's forward is the one forward of every
model (no adapter argument, no branch in ``gpt.py`` / ``llama.py``): the engine's runner sets
the step's :class:`AdapterBatch` around the forward with :func:`adapter_batch`, and every
:class:`MultiLoRALinear` reads it (vLLM's forward context and punica wrapper, nano-vllm's
``utils/context.py``). Without a batch set (a probe, a plain forward) the layer is its base.

**How the product is batched.** The batch groups the step's tokens by slot once, on the host
(index tensors built from Python lists: no device sync in any layer); each layer then does,
per adapter present, one gather of its tokens, two skinny matmuls with that adapter's ``A``
and ``B`` and one ``index_add_`` back (S-LoRA/punica's SGMV, segment by adapter, in plain
torch). Why not BGMV-style gathered weights (``bmm`` over a per-token copy of ``A`` and
``B``): that reads ``r·(in+out)`` weights *per token* (a 64-token decode step at r=16 over
4096-wide layers copies 64 adapters' worth of bytes instead of three), and decode is bound by
bytes; the segment loop reads each present adapter's weights once and its cost grows with the
number of adapters in the step (a handful), not the number of tokens. A step served by one
adapter alone skips the gather and the scatter. On GPU a fused punica/triton kernel would do
the loop in one launch; this is the readable reference every device runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmlab.models.lora_layer import BaseLayerProxy, LoRAConfig, _is_linear, adapter_geometry

BASE_SLOT = -1  # a token served by the base alone


@dataclass(frozen=True)
class AdapterBatch:
    """The step's tokens grouped by adapter slot: ``groups`` is ``(slot, rows)`` per slot
    present (the base's tokens are in none), ``rows`` the token rows of the step's flattened
    ``(N, in)`` input, or ``None`` when the slot has every row."""

    num_tokens: int
    groups: tuple[tuple[int, Tensor | None], ...]

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device | str = "cpu") -> AdapterBatch:
        """From each token's slot (``-1``: the base), as a host list."""
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot != BASE_SLOT:
                rows.setdefault(slot, []).append(i)
        n = len(slots)
        groups = tuple(
            (slot, None if len(r) == n else torch.tensor(r, dtype=torch.long, device=device))
            for slot, r in sorted(rows.items())
        )
        return cls(n, groups)


_BATCH: ContextVar[AdapterBatch | None] = ContextVar("llmlab_adapter_batch", default=None)


@contextlib.contextmanager
def adapter_batch(batch: AdapterBatch | None) -> Iterator[None]:
    """Within the block every :class:`MultiLoRALinear` serves ``batch`` (step-scoped)."""
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)


class MultiLoRALinear(BaseLayerProxy, nn.Module):
    """``base_layer(x)`` plus, per token, its slot's ``s · B A x`` (module docstring).

    ``lora_A``: ``(slots, max_rank, in)``; ``lora_B``: ``(slots, max_rank, out)`` (``Bᵀ``, so a
    slot's first ``r`` rows of both are contiguous views); buffers, not parameters: served
    weights do not train. ``ranks`` and ``scalings`` are host lists (read without a sync).
    """

    def __init__(self, base_layer: nn.Module, num_slots: int, max_rank: int) -> None:
        super().__init__()
        in_features, out_features, device, dtype = adapter_geometry(base_layer)
        self.in_features, self.out_features = in_features, out_features
        self.base_layer = base_layer
        self.max_rank = max_rank
        slots = dict(device=device, dtype=dtype)
        self.register_buffer("lora_A", torch.zeros(num_slots, max_rank, in_features, **slots))
        self.register_buffer("lora_B", torch.zeros(num_slots, max_rank, out_features, **slots))
        self.ranks = [0] * num_slots
        self.scalings = [0.0] * num_slots

    @torch.no_grad()
    def set_slot(self, slot: int, a: Tensor, b: Tensor, scaling: float) -> None:
        """Slot ``slot`` serves ``A`` (r, in) and ``B`` (out, r) with scale ``scaling``."""
        r = a.shape[0]
        if a.shape != (r, self.in_features) or b.shape != (self.out_features, r):
            raise ValueError(
                f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a layer of "
                f"{self.in_features} -> {self.out_features}"
            )
        if r > self.max_rank:
            raise ValueError(f"adapter rank {r} exceeds the layer's max_rank {self.max_rank}")
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.lora_A[slot, :r] = a
        self.lora_B[slot, :r] = b.T
        self.ranks[slot], self.scalings[slot] = r, float(scaling)

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        batch = _BATCH.get()
        if batch is None or not batch.groups:
            return result
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != batch.num_tokens:
            raise ValueError(
                f"MultiLoRALinear got {flat.shape[0]} rows in a step of {batch.num_tokens} "
                "tokens: only layers that see every token of the step can carry served adapters"
            )
        out = result.view(-1, result.shape[-1])
        for slot, rows in batch.groups:
            r = self.ranks[slot]
            if r == 0:  # this adapter does not target this layer
                continue
            a, b = self.lora_A[slot, :r], self.lora_B[slot, :r]
            xs = flat if rows is None else flat.index_select(0, rows)
            delta = ((xs.to(a.dtype) @ a.T) @ b * self.scalings[slot]).to(out.dtype)
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
        return result

    def extra_repr(self) -> str:
        return f"slots={len(self.ranks)}, max_rank={self.max_rank}, ranks={self.ranks}"


def add_adapter_slots(
    model: nn.Module, layers: Sequence[str], num_slots: int, max_rank: int
) -> dict[str, MultiLoRALinear]:
    """Wrap the linear layers named ``layers`` of ``model`` in :class:`MultiLoRALinear` with
    ``num_slots`` empty slots of rank up to ``max_rank``, in place; returns them by name."""
    out: dict[str, MultiLoRALinear] = {}
    for name in layers:
        base = model.get_submodule(name)
        if not _is_linear(base):
            raise ValueError(f"{name} is a {type(base).__name__}, not a linear layer")
        layer = MultiLoRALinear(base, num_slots, max_rank)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        out[name] = layer
    return out


def adapter_slot_layers(model: nn.Module) -> dict[str, MultiLoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)}


def scaling_of(config: LoRAConfig) -> float:
    return config.alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def load_adapter_slot(
    model: nn.Module, slot: int, config: LoRAConfig, state: dict[str, Tensor]
) -> None:
    """Put one adapter (``state`` under :func:`~llmlab.models.lora.lora_state_dict`'s names,
    its rank and scale from ``config``) in ``slot`` of the model's :class:`MultiLoRALinear`
    layers; the layers it does not target keep rank 0 there."""
    layers = adapter_slot_layers(model)
    targets = {k.rsplit(".", 2)[0] for k in state}
    missing = sorted(targets - set(layers))
    if missing:
        raise ValueError(f"adapter targets {missing[:3]}, which carry no adapter slots")
    scaling = scaling_of(config)
    for name, layer in layers.items():
        if name in targets:
            a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
            layer.set_slot(slot, a.to(layer.lora_A), b.to(layer.lora_B), scaling)
        else:
            layer.ranks[slot], layer.scalings[slot] = 0, 0.0
