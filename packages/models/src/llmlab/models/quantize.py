"""Weight-only quantization: fewer bytes per weight, the lever of decoding at real sizes.

Decoding one token reads every weight once, so its speed is bounded by memory bandwidth: bytes
per token over the bytes per second the machine reads (the roofline). Storing the weights in
fewer bytes moves that bound, as llama.cpp's Q8_0 / Q4_0 blocks do:

* ``bf16``: the weights rounded to bfloat16 (2 bytes), stored in tiles of 8 output rows
  that a one-row product reads as one stream (:mod:`llmlab.kernels.quantized`);
* ``int8``: per output channel, ``w ≈ s_o · q`` with ``q`` in [-127, 127] and
  ``s_o = max_i |w_oi| / 127`` (1 byte + 4 bytes per row);
* ``int4`` (group ``g`` = 32, 64 or 128 along the input): ``w ≈ s_{o,j} · q`` with ``q`` in
  [-8, 7] and per group the step, from ``max |w| / 8`` (llama.cpp's Q4_0 rule) to ``/ 7``,
  with the least squared error, two values per byte (0.5 byte + 4 bytes per group). Within a
  group the first half sits in the low nibbles, the second half in the high nibbles, so
  unpacking is two masks and no interleave.

Under int4 the output layer (the LM head and an embedding tied to it) stays int8, as llama.cpp
keeps its output tensor at more bits than the rest: the logits are where rounding costs most.

:func:`quantize` swaps every ``nn.Linear`` for a :class:`QuantizedLinear` and every
``nn.Embedding`` for a :class:`QuantizedEmbedding`, in place, and releases the full-precision
weights; a tied embedding and LM head share one quantized table (its per-row scales are the
head's per-output-channel scales). The activations stay in the model's dtype ("weight-only").

The product computes ``x @ dequantize(W).T`` (+ bias), and nothing else (tests hold it to 1e-4
of that product in fp32), through :func:`llmlab.kernels.quantized.quantized_matmul`: on a CPU a
kernel that reads the packed bytes and widens them in registers (each widened weight vector
serving up to four rows), elsewhere a ``torch.compile``d reduction for one or two rows or the
widened weight through ``F.linear``. The modules are frozen: usable as the base of adapters in
training (QLoRA), where the input gradient ``grad_out @ dequantize(W)`` is computed in the
backward, one layer's weight widened at a time (:class:`llmlab.kernels.quantized.
QuantizedMatmul`): the graph keeps the packed bytes, never a full-precision copy of the base.
:func:`dequantize` turns a quantized model back into plain float layers holding the weights it
computes with (what a merged export of a quantized base writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmlab.kernels.quantized import INT4_GROUPS, quantized_matmul, take_rows
from llmlab.kernels.quantized import pack as kernel_pack
from llmlab.kernels.quantized import unpack as kernel_unpack
from llmlab.models.linear import Linear

VALID = "bf16, int8, int4 (group 32), int4:g64, int4:g128"


@dataclass(frozen=True)
class Scheme:
    kind: str  # "bf16", "int8" or "int4"
    group: int | None = None  # int4's group size along the input dimension

    def __str__(self) -> str:
        return self.kind if self.kind != "int4" or self.group == 32 else f"int4:g{self.group}"


def parse_scheme(name: str | Scheme) -> Scheme:
    """``"bf16"``, ``"int8"``, ``"int4"`` (group 32) or ``"int4:g64"`` / ``"int4:g128"``."""
    if isinstance(name, Scheme):
        return name
    kind, _, rest = str(name).partition(":")
    if kind in ("bf16", "int8") and not rest:
        return Scheme(kind)
    if kind == "int4":
        group = 32 if not rest else int(rest[1:]) if rest[1:].isdigit() and rest[0] == "g" else 0
        if group in INT4_GROUPS:
            return Scheme("int4", group)
    raise ValueError(f"quantize={name!r} is not a scheme; valid: {VALID}")


def pack(weight: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor | None]:
    """``(data, scales)`` of ``weight`` (out, in) in ``scheme``'s layout
    (:mod:`llmlab.kernels.quantized`)."""
    return kernel_pack(weight, scheme.kind, scheme.group)


def unpack(data: Tensor, scales: Tensor | None, scheme: Scheme, dtype: torch.dtype) -> Tensor:
    """The weight (out, in) that ``data`` and ``scales`` stand for, in ``dtype``."""
    return kernel_unpack(data, scales, scheme.kind, dtype)


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in ``scheme``'s bytes (module docstring)."""

    def __init__(
        self,
        data: Tensor,
        scales: Tensor | None,
        bias: Tensor | None,
        in_features: int,
        scheme: Scheme,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, data.shape[0]
        self.scheme = scheme
        self.register_buffer("data", data)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme) -> QuantizedLinear:
        data, scales = pack(linear.weight, scheme)
        return cls(data, scales, linear.bias, linear.in_features, scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return unpack(self.data, self.scales, self.scheme, dtype)

    def forward(self, x: Tensor) -> Tensor:
        out = quantized_matmul(x, self.data, self.scales, self.scheme.kind)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"


class QuantizedEmbedding(nn.Module):
    """A frozen ``nn.Embedding`` in ``scheme``'s bytes: a lookup widens only the rows it reads.
    Its storage is shared with a tied LM head (:func:`quantize`)."""

    def __init__(
        self,
        data: Tensor,
        scales: Tensor | None,
        dim: int,
        scheme: Scheme,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme = data.shape[0], dim, scheme
        self.dtype = dtype  # what the rows come out as: the model's dtype
        self.register_buffer("data", data)
        self.register_buffer("scales", scales)

    def forward(self, ids: Tensor) -> Tensor:
        rows = take_rows(self.data, self.scales, self.scheme.kind, ids.reshape(-1), self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.scheme}"


def quantize_problem(model: nn.Module, scheme: str | Scheme) -> str | None:
    """Why :func:`quantize` would refuse ``model`` (any device, ``meta`` included), or None:
    a layer of another class, or an input width that int4's group does not divide. Checked for
    every layer before any is converted."""
    scheme = parse_scheme(scheme)
    targets = [
        (name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
    ]
    odd = [
        f"{name} ({type(m).__name__})"
        for name, m in targets
        if type(m) not in (nn.Linear, Linear, nn.Embedding)
    ]
    if odd:
        return (
            f"quantize: cannot convert {', '.join(odd)}; only plain nn.Linear and "
            "nn.Embedding layers are quantized (quantize before parallelizing)"
        )
    if scheme.kind == "int4":
        for name, module in targets:
            width = module.weight.shape[1]
            if width % scheme.group:
                return (
                    f"quantize: {name} has {width} inputs, not a multiple of "
                    f"int4's group {scheme.group}; valid: {VALID}"
                )
    return None


# The output layer (the LM head, by its module name, and an embedding tied to it) is stored in
# int8 where the scheme is int4: llama.cpp's rule (its Q4_0 files keep output.weight in Q6_K, or
# Q8_0 where rows are not multiples of 256, and a tied token embedding with it). Measured on the
# GPT that ``make train`` produces: int4 everywhere 8.3 % above fp32's perplexity, with the head
# in int8 2.0 % (benchmarks/quantize.py).
OUTPUT_LAYER = "lm_head"
OUTPUT_SCHEME = Scheme("int8")


def quantize(model: nn.Module, scheme: str | Scheme) -> nn.Module:
    """Quantize every ``nn.Linear`` and ``nn.Embedding`` of ``model`` in place (module
    docstring) and return it; under int4 the output layer is int8 (``OUTPUT_LAYER``). Layers
    of other classes (a tensor-parallel shard, an adapter) are refused by name: quantize before
    making a model parallel, and wrap adapters afterwards."""
    scheme = parse_scheme(scheme)
    if problem := quantize_problem(model, scheme):
        raise ValueError(problem)
    targets = [
        (name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
    ]
    # tied weights are packed once: which layers share a weight is read while every weight is
    # alive (ids unique); then no full-precision module is held here, each freed once replaced
    tie = {name: id(module.weight) for name, module in targets}
    output = {tie[name] for name in tie if name.rpartition(".")[2] == OUTPUT_LAYER}
    del targets
    shared: dict[int, tuple[Tensor, Tensor | None, Scheme]] = {}
    for name, key in tie.items():
        module = model.get_submodule(name)
        weight = module.weight
        if key not in shared:
            own = OUTPUT_SCHEME if scheme.kind == "int4" and key in output else scheme
            shared[key] = (*pack(weight, own), own)
        data, scales, own = shared[key]
        if isinstance(module, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(
                data, scales, module.embedding_dim, own, weight.dtype
            )
        else:
            new = QuantizedLinear(data, scales, module.bias, module.in_features, own)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def dequantize(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Swap every :class:`QuantizedLinear` / :class:`QuantizedEmbedding` of ``model`` for a
    plain ``nn.Linear`` / ``nn.Embedding`` holding its dequantized weight in ``dtype``, in place,
    and return it: the same function in float layers (not the original weights: the rounding
    stays). Layers that shared one quantized table share one float weight again (a tied
    embedding and head); the new weights are frozen like the quantized ones were."""
    shared: dict[int, nn.Parameter] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            continue
        key = module.data.data_ptr()
        if key not in shared:
            weight = unpack(module.data, module.scales, module.scheme, dtype)
            shared[key] = nn.Parameter(weight, requires_grad=False)
        if isinstance(module, QuantizedEmbedding):
            new: nn.Module = nn.Embedding(
                module.num_embeddings, module.embedding_dim, device="meta", dtype=dtype
            )
        else:
            bias = module.bias is not None
            new = Linear(module.in_features, module.out_features, bias, device="meta", dtype=dtype)
            if bias:
                new.bias = nn.Parameter(module.bias.to(dtype), requires_grad=False)
        new.weight = shared[key]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def output_width(linear: nn.Module) -> int:
    """Output features a linear layer holds here: its weight's rows (a tensor-parallel shard's
    share), or a quantized layer's ``out_features``."""
    weight = getattr(linear, "weight", None)
    return weight.shape[0] if isinstance(weight, Tensor) else linear.out_features


def float_weight_bytes(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """:func:`weight_bytes` as if every quantized table were widened to ``dtype`` (a shared
    table once): the weights' size before :func:`quantize`, for reports."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    size = torch.empty((), dtype=dtype).element_size()
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            width = (
                module.in_features
                if isinstance(module, QuantizedLinear)
                else (module.embedding_dim)
            )
            seen[module.data.data_ptr()] = module.data.shape[0] * width * size
            if module.scales is not None:
                seen[module.scales.data_ptr()] = 0
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (ties shared)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
