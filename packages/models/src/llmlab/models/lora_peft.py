"""LoRA adapters in peft's folder format, so peft and llmlab read each other's adapters.

``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<HF module>.lora_A.weight``: the HF module names are those ``save_pretrained``
writes the base under, and GPT-2's fused ``c_attn`` rows are reordered like the base weight's
(:mod:`llmlab.models.lora`'s docstring). Kept apart from the layer because it is the only part
that knows HF's module names and file layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from llmlab.models.lora_layer import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class _HFModule:
    name: str  # the module's name in the transformers model
    qkv_heads: tuple[int, int] | None  # GPT-2's fused c_attn: (heads, head_dim)


def hf_module_names(config: Any) -> dict[str, _HFModule]:
    """llmlab module name -> its module in the ``transformers`` model ``save_pretrained``
    writes, derived from the same name map (:mod:`llmlab.models.hf.names`)."""
    from llmlab.models.hf.names import sources_for

    out: dict[str, _HFModule] = {}
    for name, source in sources_for(config).items():
        if name.endswith(".weight"):
            hf = source.hf_name.removesuffix(".weight")
            out[name.removesuffix(".weight")] = _HFModule(hf, source.qkv_heads)
    out["head.lm_head"] = _HFModule("lm_head", None)  # tied or not, a module of its own in HF
    return out


def _qkv_to_hf(b: Tensor, heads: tuple[int, int]) -> Tensor:
    """B's rows, llmlab's per-head ``[q_h, k_h, v_h]`` -> GPT-2's ``[q | k | v]``."""
    n, d = heads
    return b.reshape(n, 3, d, -1).transpose(0, 1).reshape(3 * n * d, -1).contiguous()


def _qkv_from_hf(b: Tensor, heads: tuple[int, int]) -> Tensor:
    n, d = heads
    return b.reshape(3, n, d, -1).transpose(0, 1).reshape(3 * n * d, -1).contiguous()


def _model_config(model: nn.Module) -> Any:
    from llmlab.models.gpt_config import GPTConfig
    from llmlab.models.llama_config import LlamaConfig

    config = getattr(model, "config", None)
    if not isinstance(config, (GPTConfig, LlamaConfig)):
        raise TypeError(
            f"peft's adapter format needs an llmlab GPT or Llama (HF module names), got "
            f"{type(model).__name__}"
        )
    return config


def save_lora(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write the adapters of ``model`` as a peft adapter folder (module docstring) that
    ``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` model of the base's HF
    folder, and :func:`load_lora` loads onto the llmlab model. Returns ``out_dir``."""
    from safetensors.torch import save_file

    from llmlab.models.gpt_config import GPTConfig

    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_lora: the model has no LoRA adapters (apply_lora first)")
    shapes = {(m.r, m.alpha, m.use_rslora, _dropout(m)) for m in layers.values()}
    if len(shapes) > 1:
        raise ValueError(f"save_lora: adapters of different shapes {sorted(shapes)}; one per model")
    r, alpha, rslora, dropout = next(iter(shapes))
    tensors = to_peft_state_dict(model)
    targets = [k[len(PEFT_PREFIX) : -len(".lora_A.weight")] for k in tensors if ".lora_A." in k]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "target_modules": targets,  # exact module names: peft adapts exactly these
        "bias": "none",
        # GPT-2's Conv1D stores (in, out): peft sets this itself for it (with a warning)
        "fan_in_fan_out": isinstance(_model_config(model), GPTConfig),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def to_peft_state_dict(
    model: nn.Module, state: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """``state`` (default: :func:`lora_state_dict`; any tensors under its names, gradients
    say) under peft's keys and layouts, on the CPU: what ``adapter_model.safetensors`` holds."""
    names = hf_module_names(_model_config(model))
    state = lora_state_dict(model) if state is None else state
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        layer, part, _ = key.rsplit(".", 2)
        hf = names[layer]
        tensor = tensor.detach().cpu()
        if part == "lora_B" and hf.qkv_heads is not None:
            tensor = _qkv_to_hf(tensor, hf.qkv_heads)
        out[f"{PEFT_PREFIX}{hf.name}.{part}.weight"] = tensor.contiguous()
    return out


def _dropout(layer: LoRALinear) -> float:
    return layer.lora_dropout.p if isinstance(layer.lora_dropout, nn.Dropout) else 0.0


# peft settings llmlab's LoRA does not compute: refused by name, never silently dropped
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "lora_bias": (False, None),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
}


def read_lora_config(path: str | Path) -> LoRAConfig:
    """The :class:`LoRAConfig` of a peft adapter folder (its ``adapter_config.json``), with
    every peft setting llmlab does not compute refused by name. ``target_modules`` is left as
    peft wrote it (HF module names); :func:`load_lora` adapts what the weights file holds."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.exists():
        raise FileNotFoundError(f"{file}: no peft adapter config here")
    raw = json.loads(file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type={raw['peft_type']!r}; only LORA adapters load")
    for key, fine in _UNSUPPORTED.items():
        if key in raw and raw[key] not in fine:
            raise ValueError(f"{file}: {key}={raw[key]!r} is not supported by llmlab's LoRA")
    return LoRAConfig(
        r=int(raw["r"]),
        alpha=float(raw.get("lora_alpha", 8)),
        dropout=float(raw.get("lora_dropout", 0.0)),
        target_modules=raw.get("target_modules") or "all-linear",
        use_rslora=bool(raw.get("use_rslora", False)),
    )


def read_lora(model: nn.Module, path: str | Path) -> tuple[LoRAConfig, dict[str, Tensor]]:
    """The adapter of the peft folder ``path`` for ``model`` (an llmlab GPT or Llama, the base
    it was trained on), without touching the model: its :class:`LoRAConfig` (``target_modules``
    the llmlab names of the layers the weights file holds) and its tensors under llmlab's names
    (``<layer>.lora_A.weight``, as :func:`lora_state_dict`)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_lora_config(path)
    file = path / ADAPTER_WEIGHTS
    if not file.exists():
        raise FileNotFoundError(
            f"{file}: missing (only safetensors adapters load; a pickled adapter_model.bin is "
            "refused)"
        )
    tensors = load_file(str(file))
    ours = {hf.name: (name, hf) for name, hf in hf_module_names(_model_config(model)).items()}
    state: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight", key)
        if m is None or m.group(1) not in ours:
            raise ValueError(f"{file}: tensor {key!r} is no LoRA weight of a layer of this model")
        name, hf = ours[m.group(1)]
        if m.group(2) == "lora_B" and hf.qkv_heads is not None:
            tensor = _qkv_from_hf(tensor, hf.qkv_heads)
        state[f"{name}.{m.group(2)}.weight"] = tensor
    layers = sorted({k.rsplit(".", 2)[0] for k in state})
    return LoRAConfig(config.r, config.alpha, config.dropout, layers, config.use_rslora), state


def load_lora(model: nn.Module, path: str | Path) -> nn.Module:
    """Put the adapters of the peft folder ``path`` on ``model`` (an llmlab GPT or Llama
    without adapters, the base they were trained on) and return it: the layers the weights
    file holds get :class:`LoRALinear` with the file's ``A`` and ``B``."""
    config, state = read_lora(model, path)
    layers = config.target_modules
    apply_lora(model, config)
    if set(lora_layers(model)) != set(layers):
        raise ValueError(
            f"{Path(path) / ADAPTER_WEIGHTS}: adapters {layers[:3]} did not land on those "
            "layers alone"
        )
    load_lora_state_dict(model, state)
    return model
