"""Weight-only quantization: fewer bytes per weight, the lever of decoding at real sizes.

Decoding one token reads every weight once, so its speed is bounded by memory bandwidth: bytes
per token over the bytes per second the machine reads (the roofline). Storing the weights in
fewer bytes moves that bound, as llama.cpp's Q8_0 / Q4_0 blocks do:

* ``bf16``: the weights rounded to bfloat16 (2 bytes);
* ``int8``: per output channel, ``w ≈ s_o · q`` with ``q`` in [-127, 127] and
  ``s_o = max_i |w_oi| / 127`` (1 byte + 4 bytes per row);
* ``int4`` (group ``g`` = 32, 64 or 128 along the input): ``w ≈ s_{o,j} · q`` with ``q`` in
  [-8, 7] and ``s = max |w| / 7`` over each group, two values per byte (0.5 byte + 4 bytes
  per group). Within a group the first half sits in the low nibbles, the second half in the high
  nibbles, so unpacking is two masks and no interleave.

:func:`quantize` swaps every ``nn.Linear`` for a :class:`QuantizedLinear` and every
``nn.Embedding`` for a :class:`QuantizedEmbedding`, in place, and releases the full-precision
weights; a tied embedding and LM head share one quantized table (its per-row scales are the
head's per-output-channel scales). The activations stay in the model's dtype ("weight-only").

The product computes ``x @ dequantize(W).T`` (+ bias), and nothing else (tests hold it to 1e-4
of that product in fp32): for one or two rows (decoding) a reduction over the packed weights,
compiled by ``torch.compile`` so the weights are read in their small form and widened in
registers; for more rows (prefill, training) the weights are widened once and go through the
matmul (the widening is paid once for all rows). The modules are frozen: usable as the base of
adapters in training, where input gradients flow through the same product.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT4_GROUPS = (32, 64, 128)
KINDS = ("bf16", "int8", "int4")
VALID = "bf16, int8, int4 (group 32), int4:g64, int4:g128"
DECODE_ROWS = 2  # products of at most this many rows read the packed weights directly


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


# ------------------------------------------------------------------------------ packing
def pack(weight: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor | None]:
    """``(data, scales)`` of ``weight`` (out, in) in ``scheme``'s layout (module docstring)."""
    w = weight.detach().float()
    if scheme.kind == "bf16":
        return weight.detach().to(torch.bfloat16), None
    if scheme.kind == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales
    out, inp = w.shape
    g = scheme.group
    if inp % g:
        raise ValueError(f"int4 with group {g} needs an input width divisible by {g}, got {inp}")
    groups = w.view(out, inp // g, g)
    scales = (groups.abs().amax(dim=2) / 7).clamp(min=torch.finfo(torch.float32).tiny)
    q = (torch.round(groups / scales[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    half = g // 2
    data = q[..., :half] | (q[..., half:] << 4)  # (out, in/g, g/2)
    return data.reshape(out, inp // 2).contiguous(), scales


def unpack(data: Tensor, scales: Tensor | None, scheme: Scheme, dtype: torch.dtype) -> Tensor:
    """The weight (out, in) that ``data`` and ``scales`` stand for, in ``dtype``."""
    if scheme.kind == "bf16":
        return data.to(dtype)
    if scheme.kind == "int8":
        return (data.float() * scales[:, None]).to(dtype)
    out, g = data.shape[0], scheme.group
    nibbles = data.view(out, -1, g // 2)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).float() - 8  # (out, in/g, g)
    return (q * scales[..., None]).reshape(out, -1).to(dtype)


# ----------------------------------------------------------------------- decode products
def _int8_rows(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return (x.unsqueeze(-2) * data).sum(-1) * scales


def _bf16_rows(x: Tensor, data: Tensor, scales: Any) -> Tensor:
    return (x.unsqueeze(-2) * data).sum(-1)


def _int4_rows(x: Tensor, data: Tensor, scales: Tensor, group: int) -> Tensor:
    # one reduction over in/2 packed bytes: each byte's low nibble meets the first half of its
    # group's inputs, the high nibble the second half, scaled by its group's scale
    half, rows = group // 2, x.shape[0]
    groups = x.view(rows, -1, group)
    x_lo = groups[..., :half].reshape(rows, 1, -1)
    x_hi = groups[..., half:].reshape(rows, 1, -1)
    lo = (data & 15).to(torch.float32) - 8
    hi = (data >> 4).to(torch.float32) - 8
    return ((x_lo * lo + x_hi * hi) * scales.repeat_interleave(half, dim=1)).sum(-1)


# The group size must reach the compiler as a literal: passed through a closure or
# functools.partial it became a dynamic size and the kernel ran 50-100x slower (measured).
def _int4_g32(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 32)


def _int4_g64(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 64)


def _int4_g128(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 128)


_INT4 = {32: _int4_g32, 64: _int4_g64, 128: _int4_g128}


_COMPILED: dict[Scheme, Any] = {}


def _eager_product(scheme: Scheme) -> Any:
    if scheme.kind == "int4":
        return _INT4[scheme.group]
    return _int8_rows if scheme.kind == "int8" else _bf16_rows


def _rows_product(scheme: Scheme) -> Any:
    """The decode product of ``scheme``, compiled once per process (eager where compiling
    fails, e.g. with no C++ compiler: the same arithmetic, slower)."""
    if scheme not in _COMPILED:
        _COMPILED[scheme] = torch.compile(_eager_product(scheme), dynamic=True)
    return _COMPILED[scheme]


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in ``scheme``'s bytes (module docstring)."""

    def __init__(self, data: Tensor, scales: Tensor | None, bias: Tensor | None,
                 in_features: int, scheme: Scheme) -> None:  # fmt: skip
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
        rows = x.numel() // self.in_features
        if rows <= DECODE_ROWS and not (torch.is_grad_enabled() and x.requires_grad):
            flat = x.reshape(rows, self.in_features).float()
            try:
                out = _rows_product(self.scheme)(flat, self.data, self.scales)
            except Exception as err:  # no C++ compiler here: the same product, eager
                warnings.warn(f"quantized products run eagerly (torch.compile failed: {err})",
                              RuntimeWarning, stacklevel=2)  # fmt: skip
                _COMPILED[self.scheme] = _eager_product(self.scheme)
                out = _COMPILED[self.scheme](flat, self.data, self.scales)
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"


class QuantizedEmbedding(nn.Module):
    """A frozen ``nn.Embedding`` in ``scheme``'s bytes: a lookup widens only the rows it reads.
    Its storage is shared with a tied LM head (:func:`quantize`)."""

    def __init__(self, data: Tensor, scales: Tensor | None, dim: int, scheme: Scheme,
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme = data.shape[0], dim, scheme
        self.dtype = dtype  # what the rows come out as: the model's dtype
        self.register_buffer("data", data)
        self.register_buffer("scales", scales)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        scales = None if self.scales is None else self.scales[flat]
        rows = unpack(self.data[flat], scales, self.scheme, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.scheme}"


def quantize(model: nn.Module, scheme: str | Scheme) -> nn.Module:
    """Quantize every ``nn.Linear`` and ``nn.Embedding`` of ``model`` in place (module
    docstring) and return it. Layers of other classes (a tensor-parallel shard, an adapter) are
    refused by name: quantize before making a model parallel, and wrap adapters afterwards."""
    scheme = parse_scheme(scheme)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear,
               nn.Embedding))]  # fmt: skip
    odd = [f"{name} ({type(m).__name__})" for name, m in targets
           if type(m) not in (nn.Linear, nn.Embedding)]  # fmt: skip
    if odd:
        raise ValueError(
            f"quantize: cannot convert {', '.join(odd)}; only plain nn.Linear and "
            "nn.Embedding layers are quantized (quantize before parallelizing)"
        )
    if scheme.kind == "int4":  # checked for every layer before any is converted
        for name, module in targets:
            width = module.weight.shape[1]
            if width % scheme.group:
                raise ValueError(f"quantize: {name} has {width} inputs, not a multiple of "
                                 f"int4's group {scheme.group}; valid: {VALID}")  # fmt: skip
    shared: dict[int, tuple[Tensor, Tensor | None]] = {}  # tied weights: packed once
    for name, module in targets:
        weight = module.weight
        if id(weight) not in shared:
            shared[id(weight)] = pack(weight, scheme)
        data, scales = shared[id(weight)]
        if isinstance(module, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(data, scales, module.embedding_dim, scheme,
                                                weight.dtype)  # fmt: skip
        else:
            new = QuantizedLinear(data, scales, module.bias, module.in_features, scheme)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def output_width(linear: nn.Module) -> int:
    """Output features a linear layer holds here: its weight's rows (a tensor-parallel shard's
    share), or a quantized layer's ``out_features``."""
    weight = getattr(linear, "weight", None)
    return weight.shape[0] if isinstance(weight, Tensor) else linear.out_features


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (ties shared)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
