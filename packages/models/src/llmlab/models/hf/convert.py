"""In-memory conversion: a ``transformers`` model's config and state dict -> an llmlab model,
through the same field checks and name maps as reading a folder (``Llama.from_hf``,
``GPT.from_hf_gpt2``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.hf.configs import from_hf_config
from llmlab.models.hf.loading import USE_SETTINGS, load_model


class StateDictCheckpoint:
    """A state dict seen through :class:`~llmlab.models.hf.folder.CheckpointFolder`'s reading
    interface (``tensors``, ``shape``, ``read``, ``dtype``)."""

    path = "<in-memory transformers model>"

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self.tensors = dict(state)
        self.bytes_read = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        tensor = self.tensors[name].detach()
        tensor = (tensor[index] if index else tensor).clone()
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def dtype(self) -> torch.dtype | None:
        return next((t.dtype for t in self.tensors.values() if t.is_floating_point()), None)


def model_from_hf_state(
    model_cls: type[nn.Module],
    config_cls: type,
    hf_config: Mapping[str, Any],
    state: Mapping[str, Tensor],
    use: Mapping[str, Any],
) -> nn.Module:
    """A ``model_cls`` (llmlab's GPT or Llama) from a ``transformers`` config dict and state
    dict; ``use`` as in ``from_pretrained`` (``kernels``, ``block_size``, ``dropout``)."""
    arch, fields = from_hf_config(dict(hf_config), "transformers config")
    expected = {"GPTConfig": "gpt", "LlamaConfig": "llama"}[config_cls.__name__]
    if arch != expected:
        raise ValueError(
            f"{model_cls.__name__} cannot load a model_type={hf_config.get('model_type')!r} "
            f"model (it is llmlab's {arch!r}); use llmlab.models.from_pretrained"
        )
    unknown = sorted(set(use) - set(USE_SETTINGS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a setting; valid: {USE_SETTINGS}")
    fields.update({k: v for k, v in use.items() if v is not None})
    return load_model(StateDictCheckpoint(state), {"arch": arch, **fields}, model_cls, config_cls)
