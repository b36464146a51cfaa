"""LoRA adapters served side by side over one base (``LLMEngine(..., adapters={...})``).

Every adapter given at start gets a slot of the model's
:class:`~llmlab.models.lora_serving.MultiLoRALinear` layers (the union of the adapters'
targets, ranks padded to the largest; ``llmlab.models.lora_serving`` says how one step's
product is batched). A request names its adapter in ``RequestOptions.adapter`` (``None``: the
base); the runner turns a step's chunks into each token's slot and sets that
:class:`~llmlab.models.lora_serving.AdapterBatch` around the model's one forward.

An adapter is a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``, read by
:func:`llmlab.models.lora.read_lora`) or a ``(LoRAConfig, state)`` pair, ``state`` under
:func:`llmlab.models.lora.lora_state_dict`'s names. The LM head cannot carry a served adapter
(only the kept rows reach it, not the step's tokens); that is refused at start, as is a name
that is empty or the base's.

Prefix caching keys a sequence's blocks by its adapter too (``Sequence.cache_salt``): the
same prompt under two adapters has different keys and values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from llmlab.models.lora import OUTPUT_LAYER, LoRAConfig, read_lora
from llmlab.models.lora_serving import (
    AdapterBatch,
    adapter_batch,
    add_adapter_slots,
    load_adapter_slot,
)

AdapterSource = str | Path | tuple[LoRAConfig, Mapping[str, Tensor]]


def read_adapter(model: nn.Module, name: str, source: AdapterSource) -> tuple[LoRAConfig, dict]:
    """``(config, state)`` of one adapter, checked against ``model``'s linear layers."""
    if isinstance(source, (str, Path)):
        try:
            config, state = read_lora(model, source)
        except (ValueError, FileNotFoundError, TypeError) as err:
            raise type(err)(f"adapter {name!r}: {err}") from err
    else:
        config, state = source[0], dict(source[1])
    layers = sorted({k.rsplit(".", 2)[0] for k in state})
    if not layers:
        raise ValueError(f"adapter {name!r} holds no LoRA weights")
    own = dict(model.named_modules())
    for layer in layers:
        a, b = state.get(f"{layer}.lora_A.weight"), state.get(f"{layer}.lora_B.weight")
        if a is None or b is None or len(state) != 2 * len(layers):
            raise ValueError(
                f"adapter {name!r}: {layer} needs exactly lora_A.weight and lora_B.weight"
            )
        if layer not in own:
            raise ValueError(f"adapter {name!r}: the model has no layer {layer!r}")
        if fnmatchcase(layer, OUTPUT_LAYER):
            raise ValueError(
                f"adapter {name!r} targets the LM head ({layer}): served adapters go on the "
                "layers that see every token of a step, not the head"
            )
        if a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(
                f"adapter {name!r}: {layer} has rank {a.shape[0]}, its config r={config.r}"
            )
    return config, state


class ServedAdapters:
    """The engine's adapters by name, each in its slot of the model's adapter layers."""

    def __init__(
        self, model: nn.Module, adapters: Mapping[str, AdapterSource] | None, base_name: str = ""
    ) -> None:
        adapters = dict(adapters or {})
        for name in adapters:
            if not isinstance(name, str) or not name or name == base_name:
                raise ValueError(f"adapter name {name!r}: a non-empty name other than the base's")
        read = {name: read_adapter(model, name, src) for name, src in adapters.items()}
        self.slots = {name: slot for slot, name in enumerate(read)}
        if not read:
            return
        layers = sorted({k.rsplit(".", 2)[0] for _, state in read.values() for k in state})
        max_rank = max(config.r for config, _ in read.values())
        add_adapter_slots(model, layers, len(read), max_rank)
        for name, (config, state) in read.items():
            load_adapter_slot(model, self.slots[name], config, state)
        self.ranks = {name: config.r for name, (config, _) in read.items()}
        self.layers = layers

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def __bool__(self) -> bool:
        return bool(self.slots)

    @contextlib.contextmanager
    def step(self, chunks: list[Any], device: Any) -> Iterator[None]:
        """Around one forward over ``chunks``: each token's slot, from its request's adapter."""
        if not self.slots:
            yield
            return
        slots: list[int] = []
        for chunk in chunks:
            name = chunk.seq.request.options.adapter
            slots += [-1 if name is None else self.slots[name]] * chunk.num_tokens
        with adapter_batch(AdapterBatch.from_slots(slots, device)):
            yield
