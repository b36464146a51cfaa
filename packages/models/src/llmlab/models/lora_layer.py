"""LoRA's layer and how it goes on and comes off a model (peft's files: lora_peft).

:class:`LoRALinear` is ``y = W x + s · B A x`` over a frozen base linear layer;
:func:`apply_lora` wraps the layers a :class:`LoRAConfig` names, :func:`merge_lora`,
:func:`unmerge_lora`, :func:`merge_and_unload` and :func:`disable_lora` fold, unfold, export and
bypass the adapters, :func:`lora_state_dict` / :func:`load_lora_state_dict` are the adapters under
llmlab's names. The full story is :mod:`llmlab.models.lora`'s docstring; import from there.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.quantize import QuantizedEmbedding, QuantizedLinear, parse_scheme, quantize

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
    ``init_lora_weights``: peft's switch -- ``True`` starts ``B`` at zero (the adapter changes
    nothing at first), ``False`` leaves ``B`` random like ``A`` (tests that need ``A``'s gradient
    from the first step).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    use_rslora: bool = False
    exclude: list[str] = field(default_factory=list)  # names/globs never adapted
    quantize: str | None = None  # QLoRA: the base's scheme (quantized before wrapping)
    init_lora_weights: bool = True  # peft's: B at zero; False keeps B random

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
        if not isinstance(self.init_lora_weights, bool):  # peft's "gaussian", "pissa", ...
            raise ValueError(
                f"lora.init_lora_weights must be true (B at zero) or false (B random), got "
                f"{self.init_lora_weights!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def adapter_geometry(base_layer: nn.Module) -> tuple[int, int, torch.device, torch.dtype]:
    """``(in_features, out_features, device, dtype)`` of the adapters of ``base_layer``: its
    sizes (a float weight's shape, or a quantized layer's own), its device, and its weight's
    dtype where that is a float (full precision over a quantized base). A base still waiting
    for its weights (on ``meta``: ``init_from`` read after a parallel layout) gets CPU
    adapters: they are drawn now."""
    weight = getattr(base_layer, "weight", None)
    if isinstance(weight, Tensor):
        out_features, in_features = weight.shape
        device = weight.device
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
    else:  # a quantized base: its sizes; adapters in full precision
        in_features, out_features = base_layer.in_features, base_layer.out_features
        device, dtype = base_layer.data.device, torch.float32
    if device.type == "meta":
        device = torch.device("cpu")
    return in_features, out_features, device, dtype


class BaseLayerProxy:
    """``weight`` and ``bias`` read through to ``self.base_layer`` (code that reads a linear
    layer's weight, e.g. a width check, sees the base's)."""

    base_layer: nn.Module

    @property
    def weight(self) -> Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias


class LoRALinear(BaseLayerProxy, nn.Module):
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
        init_lora_weights: bool = True,
    ) -> None:
        super().__init__()
        in_features, out_features, device, dtype = adapter_geometry(base_layer)
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
        if init_lora_weights:
            nn.init.zeros_(self.lora_B.weight)
        self.merged = False
        self.disabled = False  # :func:`disable_lora`
        self.tied = False  # the base weight is shared with another layer: no merging

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
        layer = LoRALinear(
            base, config.r, config.alpha, config.dropout, config.use_rslora,
            config.init_lora_weights,
        )  # fmt: skip
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
