"""LoRA: low-rank adapters on a frozen base, read and written in peft's format.

A LoRA layer keeps its base linear layer ``W`` frozen and learns a low-rank update beside it
(Hu et al., 2021)::

    y = W x + s · B A x,    A: (r, in), B: (out, r),    s = α / r   (rsLoRA: s = α / √r)

``A`` starts kaiming-uniform and ``B`` at zero (as peft), so a fresh adapter changes nothing.
Only ``A`` and ``B`` train: for ``r ≪ in, out`` they are a small fraction of the weights, and
so are their gradients and optimizer state. The base is any linear module -- an ``nn.Linear``
or a :class:`~llmlab.models.quantize.QuantizedLinear` (QLoRA's idea: a base in int8/int4 bytes,
adapters in full precision) -- and its product goes through its own forward, so input
gradients flow through it as through any frozen layer.

* :func:`apply_lora` wraps the linear layers a :class:`LoRAConfig` names (peft's
  ``target_modules`` rules, or the presets ``"attention"``, ``"mlp"``, ``"all-linear"``) in
  :class:`LoRALinear`, in place, and freezes every other parameter of the model.
* :func:`merge_lora` folds ``s · B A`` into a float base weight (decoding then costs nothing
  extra), :func:`unmerge_lora` takes it out again (both exact to fp32 rounding);
  :func:`merge_and_unload` merges and puts the plain base layers back (what ``save_pretrained``
  exports); :func:`disable_lora` runs the base alone (a reference model for free).
* :func:`lora_state_dict` is the adapter parameters under llmlab's names;
  :func:`save_lora` / :func:`load_lora` write and read peft's folder (``adapter_config.json`` +
  ``adapter_model.safetensors``, keys ``base_model.model.<HF module>.lora_A.weight``), the HF
  module names being those ``save_pretrained`` writes the base under, so
  ``peft.PeftModel.from_pretrained(hf_model, folder)`` reads llmlab's adapters and llmlab reads
  peft's. GPT-2's fused ``c_attn`` orders its outputs ``[q | k | v]`` where llmlab's ``qkv`` goes
  head by head: ``B``'s rows are reordered like the base weight's (``A`` sees the same inputs).

No peft at run time: peft is the tests' oracle (tests/models/test_lora.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.quantize import QuantizedEmbedding, QuantizedLinear, parse_scheme, quantize

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Presets: module-name patterns (fnmatch, ``*`` crosses dots) over the model's linear layers.
# The LM head is never adapted by a preset (peft's "all-linear" leaves the output layer out too).
PRESETS: dict[str, tuple[str, ...]] = {
    "attention": ("*.attn.*",),
    "mlp": ("*.mlp.*",),
    "all-linear": ("*",),
}
OUTPUT_LAYER = "*lm_head"


@dataclass
class LoRAConfig:
    """Which linear layers get adapters, and their shape.

    ``target_modules``: a preset name (``"attention"``, ``"mlp"``, ``"all-linear"``); a list of
    names, each matching a module whose name equals it or ends with ``"." + name`` (peft's rule:
    ``["q_proj", "v_proj"]``), a glob when it holds ``*`` / ``?`` (``"blocks.0.*"``), or a
    preset; or any other string, a regular expression the whole module name must match (peft's
    rule for a string). ``r``: the rank; ``alpha``: the scale's numerator; ``use_rslora``: scale
    ``alpha / sqrt(r)`` instead of ``alpha / r``; ``dropout``: on the adapter's input (training
    only). ``quantize``: QLoRA -- a scheme of :func:`llmlab.models.quantize.parse_scheme`
    (``"int8"``, ``"int4"``, ``"int4:g64"``, ...) that :func:`apply_lora` stores the frozen
    base in (every linear layer and embedding) before it wraps the targets; ``None``: the base
    as it is. Not a peft setting: :func:`save_lora` writes the adapters alone.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    use_rslora: bool = False
    exclude: list[str] = field(default_factory=list)  # names/globs never adapted
    quantize: str | None = None  # QLoRA: the base's scheme (quantized before wrapping)

    def __post_init__(self) -> None:
        if self.quantize is not None:
            try:
                self.quantize = str(parse_scheme(str(self.quantize)))
            except ValueError as err:
                raise ValueError(f"lora.{err}") from err
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, (list, tuple)):
            self.target_modules = [str(t) for t in self.target_modules]
            if not self.target_modules:
                raise ValueError("lora.target_modules is empty: name at least one layer")
        self.exclude = [str(e) for e in self.exclude]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoRALinear(nn.Module):
    """``base_layer(x) + s · lora_B(lora_A(dropout(x)))`` (module docstring); the base frozen.

    ``weight`` and ``bias`` read through to a float base's (so code that reads a linear layer's
    width, as attention's local head count does, sees the same numbers); ``in_features`` and
    ``out_features`` are the base's.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
    ) -> None:
        super().__init__()
        weight = getattr(base_layer, "weight", None)
        if isinstance(weight, Tensor):
            out_features, in_features = weight.shape
            device = weight.device
            dtype = weight.dtype if weight.is_floating_point() else torch.float32
        else:  # a quantized base: its sizes; adapters in full precision
            in_features, out_features = base_layer.in_features, base_layer.out_features
            device, dtype = base_layer.data.device, torch.float32
        self.in_features, self.out_features = in_features, out_features
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # nn.Linear's own init of A is peft's: kaiming_uniform_(a=sqrt(5)); B starts at zero
        self.lora_A = nn.Linear(in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, out_features, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.merged = False
        self.disabled = False  # :func:`disable_lora`
        self.tied = False  # the base weight is shared with another layer: no merging

    @property
    def weight(self) -> Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias

    def delta_weight(self) -> Tensor:
        """``s · B A`` (out, in): what merging adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        if self.merged or self.disabled:
            return result
        a = self.lora_A.weight
        delta = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype)))) * self.scaling
        return (result + delta).to(result.dtype)

    def merge(self) -> None:
        """Fold ``s · B A`` into the base weight (a float base only)."""
        if self.merged:
            return
        weight = self._float_weight("merge")
        with torch.no_grad():
            weight.add_(self.delta_weight().to(weight.dtype))
        self.merged = True

    def unmerge(self) -> None:
        """Take ``s · B A`` out of the base weight again (after :meth:`merge`)."""
        if not self.merged:
            return
        weight = self._float_weight("unmerge")
        with torch.no_grad():
            weight.sub_(self.delta_weight().to(weight.dtype))
        self.merged = False

    def _float_weight(self, what: str) -> Tensor:
        weight = getattr(self.base_layer, "weight", None)
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            raise ValueError(
                f"cannot {what} LoRA into a {type(self.base_layer).__name__} base: its weight "
                "is stored quantized (merging would requantize it); keep the adapters separate "
                "or merge into a float copy of the base"
            )
        if self.tied:
            raise ValueError(
                f"cannot {what} LoRA into a weight tied to another layer (the embedding would "
                "change too); keep this layer's adapter separate"
            )
        return weight

    def extra_repr(self) -> str:
        rs = ", rsLoRA" if self.use_rslora else ""
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}{rs}"


# ----------------------------------------------------------------------------- applying
def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, QuantizedLinear))


def _matches(name: str, target: str) -> bool:
    if target in PRESETS:
        return any(fnmatchcase(name, p) for p in PRESETS[target]) and not fnmatchcase(
            name, OUTPUT_LAYER
        )
    if any(c in target for c in "*?["):
        return fnmatchcase(name, target)
    return name == target or name.endswith("." + target)


def target_names(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Names of the linear layers of ``model`` that ``config`` adapts, in module order.
    Presets, globs and a regular expression pick among the linear layers; a plain name that
    matches another kind of module, or a config that matches nothing, is refused with what the
    model has."""
    targets = config.target_modules
    listed = [targets] if isinstance(targets, str) and targets in PRESETS else targets
    linear = [n for n, m in _plain_modules(model) if _is_linear(m)]
    chosen: list[str] = []
    odd: list[str] = []
    for name, module in _plain_modules(model):
        if any(_matches(name, e) for e in config.exclude):
            continue
        if isinstance(listed, str):  # peft: a string is a regex over the whole name
            if _is_linear(module) and re.fullmatch(listed, name):
                chosen.append(name)
            continue
        plain = [t for t in listed if t not in PRESETS and not any(c in t for c in "*?[")]
        if _is_linear(module) and any(_matches(name, t) for t in listed):
            chosen.append(name)
        elif any(_matches(name, t) for t in plain):
            odd.append(name)
    if odd:
        raise ValueError(
            f"lora.target_modules={targets!r} names {odd[:3]} "
            f"({type(model.get_submodule(odd[0])).__name__}), not a linear layer; "
            f"linear layers: {_preview(linear)}"
        )
    if not chosen:
        raise ValueError(
            f"lora.target_modules={targets!r} matches no linear layer of the model; presets: "
            f"{sorted(PRESETS)}; linear layers: {_preview(linear)}"
        )
    return chosen


def _plain_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Named modules, without the inside of LoRA layers (their A and B are linear too)."""
    skip: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(s) for s in skip):
            continue
        if isinstance(module, LoRALinear):
            skip.append(name + ".")
        yield name, module


def _preview(names: Sequence[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def apply_lora(model: nn.Module, config: LoRAConfig | dict[str, Any]) -> nn.Module:
    """Wrap the linear layers ``config`` names in :class:`LoRALinear`, in place, freeze every
    other parameter of ``model``, and return it. With ``config.quantize`` the base is first
    quantized (:func:`llmlab.models.quantize.quantize`: QLoRA), then wrapped. A model that
    already has adapters is refused (one adapter per layer)."""
    if isinstance(config, dict):
        config = LoRAConfig(**config)
    if lora_layers(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    if config.quantize is not None:
        target_names(model, config)  # a bad target refused before the base is converted
        quantize(model, config.quantize)
    names = target_names(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    shared = _shared_parameters(model)
    for name in names:
        base = model.get_submodule(name)
        layer = LoRALinear(base, config.r, config.alpha, config.dropout, config.use_rslora)
        layer.tied = any(id(p) in shared for p in base.parameters(recurse=False))
        layer.train(base.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{module name: LoRALinear}`` of ``model``, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter parameters (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``), nothing
    of the frozen base: what a LoRA checkpoint holds."""
    return {
        f"{name}.{part}.weight": getattr(layer, part).weight
        for name, layer in lora_layers(model).items()
        for part in ("lora_A", "lora_B")
    }


def load_lora_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (as :func:`lora_state_dict` gives it) into the model's adapters; every
    adapter must be there with its shape, and nothing else."""
    own = lora_state_dict(model)
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise KeyError(
            f"LoRA state does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    with torch.no_grad():
        for key, tensor in own.items():
            if tuple(state[key].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"LoRA tensor {key}: shape {tuple(state[key].shape)} where the model has "
                    f"{tuple(tensor.shape)} (a different rank?)"
                )
            tensor.copy_(state[key])


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (:meth:`LoRALinear.merge`)."""
    for layer in lora_layers(model).values():
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora`."""
    for layer in lora_layers(model).values():
        layer.unmerge()
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge every adapter and put the plain base layers back: a model without LoRA layers
    whose weights are ``W + s · B A`` (peft's ``merge_and_unload``). Its parameters stay
    frozen; the caller decides what trains next."""
    for name, layer in lora_layers(model).items():
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.base_layer)
    return model


@contextlib.contextmanager
def disable_lora(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes its base alone (the adapters skipped): the frozen
    reference of DPO without a second model in memory."""
    layers = list(lora_layers(model).values())
    before = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer, was in zip(layers, before):
            layer.disabled = was


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters, each tensor counted once; a quantized base's weights
    (buffers, frozen) count in the total by the numbers they stand for (a shared table once)."""
    params = {id(p): p for p in model.parameters()}.values()
    quantized = {
        m.data.data_ptr(): m.out_features * m.in_features
        if isinstance(m, QuantizedLinear)
        else m.num_embeddings * m.embedding_dim
        for m in model.modules()
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding))
    }
    total = sum(p.numel() for p in params) + sum(quantized.values())
    return sum(p.numel() for p in params if p.requires_grad), total


# ------------------------------------------------------------------------ peft's format
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


def load_lora(model: nn.Module, path: str | Path) -> nn.Module:
    """Put the adapters of the peft folder ``path`` on ``model`` (an llmlab GPT or Llama
    without adapters, the base they were trained on) and return it: the layers the weights
    file holds get :class:`LoRALinear` with the file's ``A`` and ``B``."""
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
    apply_lora(
        model,
        LoRAConfig(config.r, config.alpha, config.dropout, layers, config.use_rslora),
    )
    if set(lora_layers(model)) != set(layers):
        raise ValueError(f"{file}: adapters {layers[:3]} did not land on those layers alone")
    load_lora_state_dict(model, state)
    return model
