"""Build a model from a plain config dict, without the caller naming (or checking) a class.

``build_model({"arch": "llama", "n_layer": 4, ...})`` is how the training task, the train app's
config validation and ``llmlab.train.sample`` make models: the dict is what Hydra composes and
what a checkpoint keeps in its hyper-parameters, so a checkpoint rebuilds its own class.
A dict without ``arch`` is a GPT (checkpoints written before the registry existed).

``{"init_from": folder, ...}`` builds the model of a Hugging Face-format folder with its weights
(``llmlab.models.from_pretrained``): the architecture comes from the folder's ``config.json``;
the dict may add the use settings (``block_size``, ``dropout``, ``kernels``) and may repeat
architecture fields only with the folder's values. Under ``torch.device("meta")`` the weights
are not read (the shape is all a layout check needs).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.gpt import GPT, GPTConfig
from llmlab.models.hf.loading import USE_SETTINGS
from llmlab.models.hf.pretrained import from_pretrained, pretrained_spec
from llmlab.models.llama import Llama, LlamaConfig
from llmlab.models.ops import count_modules_using

log = logging.getLogger(__name__)

ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {
    "gpt": (GPT, GPTConfig),
    "llama": (Llama, LlamaConfig),
}
DEFAULT_ARCH = "gpt"
INIT_FROM = "init_from"  # where the weights come from, not a config field


def register(arch: str, model_cls: type[nn.Module], config_cls: type) -> None:
    """Make ``build_model({"arch": arch, ...})`` build ``model_cls(config_cls(...))``."""
    ARCHITECTURES[arch] = (model_cls, config_cls)


def _lookup(spec: Mapping[str, Any]) -> tuple[str, type[nn.Module], type]:
    arch = spec.get("arch", DEFAULT_ARCH)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown model arch {arch!r}; valid: {sorted(ARCHITECTURES)}")
    return arch, *ARCHITECTURES[arch]


def model_config(spec: Mapping[str, Any]) -> Any:
    """The validated config dataclass that ``spec`` describes (``arch`` picks the class)."""
    arch, _, config_cls = _lookup(spec)
    fields = {k: v for k, v in spec.items() if k not in ("arch", INIT_FROM)}
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"{config_cls.__name__} (arch {arch!r}) has no field {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(known))}"
        )
    config = config_cls(**fields)
    config.validate()
    return config


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """``spec["arch"]``'s model built from the other keys, e.g. ``{"arch": "llama", ...}``, or
    the model of the folder ``spec["init_from"]`` (module docstring)."""
    if spec.get(INIT_FROM):
        model = _from_folder(spec)
        config = model.config
    else:
        _, model_cls, _ = _lookup(spec)
        config = model_config(spec)
        model = model_cls(config)
    kernels = getattr(config, "kernels", "torch")
    if kernels != "torch":  # asked for kernels: say where they run, and refuse "nowhere"
        used = count_modules_using(model, kernels)
        if not used:
            raise ValueError(
                f"kernels={kernels!r}: no module of {type(model).__name__} uses the "
                f"{kernels} op table, so the option would change nothing; use kernels='torch'"
            )
        log.info("kernels=%s: %d modules use the %s ops", kernels, used, kernels)
    return model


def from_state_dict(
    spec: Mapping[str, Any], state_dict: Mapping[str, Tensor], prefix: str = ""
) -> nn.Module:
    """``build_model(spec)`` holding the weights of ``state_dict``, in eval mode.

    Only the keys under ``prefix`` are read, with it removed: a Lightning checkpoint of the
    training task keeps the model under ``"model."`` next to other modules' weights. Loading is
    strict, so a missing or unexpected weight raises naming it. This is the one place that turns
    a checkpoint's ``(model config, weights)`` back into a model, for every reader of
    checkpoints (the sampler, the serving engine) without them knowing each other.
    """
    weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(
            f"the state dict holds no weights under prefix {prefix!r} "
            f"(its first keys: {sorted(state_dict)[:3]})"
        )
    # The weights replace any init_from folder's, so the folder is not read again.
    model = build_model({k: v for k, v in spec.items() if k != INIT_FROM})
    model.load_state_dict(weights)
    return model.eval()


def _from_folder(spec: Mapping[str, Any]) -> nn.Module:
    folder = spec[INIT_FROM]
    use = {k: spec[k] for k in USE_SETTINGS if spec.get(k) is not None}
    pretrained = pretrained_spec(folder, **use)
    for key, value in spec.items():
        if key not in (INIT_FROM, *USE_SETTINGS) and value != pretrained.get(key, value):
            raise ValueError(
                f"model.{key}={value!r} but the checkpoint {folder} has {pretrained[key]!r}; "
                f"with init_from only {', '.join(USE_SETTINGS)} may be set"
            )
    unknown = sorted(set(spec) - set(pretrained) - {INIT_FROM})
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a field of {pretrained['arch']!r} models")
    device = "meta" if torch.get_default_device().type == "meta" else None
    return from_pretrained(folder, device=device, **use)
