"""The engine's matrix products on a CPU: products of several rows through oneDNN, weights packed.

A serving step multiplies a few rows (the decoding sequences, a prefill chunk) by every weight
of the model. ``F.linear`` on a CPU goes to MKL's ``sgemm``, which on this AMD machine runs a
generic code path (``MKL_VERBOSE`` names no AVX-512, where ``ONEDNN_VERBOSE`` says oneDNN uses
it) and, for a handful of rows, costs about twice its one-row matrix-vector product. oneDNN
takes the weight already in its own blocked format (``torch.ops.mkldnn._reorder_linear_weight``,
what ``torch.compile``'s CPU backend uses for frozen weights) and multiplies with
``torch.ops.mkldnn._linear_pointwise``. Measured on the serving benchmark's GPT-2 (one thread):
the LM head (8192 × 256) takes 1.0 ms for 3 rows through MKL and 0.36 ms through oneDNN, 14 ms
against 5.6 ms for 256 rows; the layers' weights are about 2× faster from 4 rows on.

Why one row stays with ``F.linear``: a lone request then decodes with the very products
``llmlab.decoding.generate`` and HF make (the hot path is unchanged, bit for bit), and MKL's
matrix-vector product is as fast or faster for the small weights. The rule is fixed (two rows
or more: oneDNN), not timed, so which kernel computes a product never depends on the machine's
load. Products of several rows differ from ``F.linear``'s by fp32 rounding, as MKL's own
kernels for different row counts differ from one another (up to ~1e-5 here); never more.

The packed weights are a second copy of every linear weight (the model's own stay where they
are, so the model keeps working as before); a weight changed in place, or replaced, after the
engine was built is noticed (version counter and storage) and packed again before it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MIN_ROWS = 2  # products of this many rows or more go through oneDNN


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops and they compute (x86 builds)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), MIN_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


def _pack(weight: Tensor) -> Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)


def _version(weight: Tensor) -> tuple[int, int]:
    return weight._version, weight.data_ptr()


@dataclass(eq=False)
class _Packed:
    weight: Tensor  # oneDNN's blocked copy of the module's weight
    version: tuple[int, int]  # the module weight's (version counter, data pointer) when packed

    @classmethod
    def of(cls, weight: Tensor) -> _Packed:
        return cls(_pack(weight), _version(weight))


class Linears:
    """The runner's product function, ``linears(x, module)``: ``F.linear`` for one row, oneDNN
    on a packed copy of ``module.weight`` for more (see the module docstring). Covers the
    float32 CPU ``nn.Linear`` layers of ``model`` (exactly that class: a subclass has a forward
    of its own); anything else, or a disabled instance, goes to ``F.linear``."""

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self._packed: dict[nn.Linear, _Packed] = {}
        self._lazy = False  # a copy's (see __deepcopy__): pack modules when first met
        if not enabled or not onednn_available():
            return
        for module in model.modules():
            if _packable(module):
                self._packed[module] = _Packed.of(module.weight)

    def __deepcopy__(self, memo: dict) -> Linears:
        """An engine's model holds its runner (the attention it swapped in), so copying the
        model copies this; oneDNN's packed tensors cannot be copied. The copy packs the
        copied modules' weights as it first meets them."""
        clone = Linears.__new__(Linears)
        clone._packed = {}
        clone._lazy = self.enabled
        return clone

    @property
    def enabled(self) -> bool:
        return bool(self._packed) or self._lazy

    def __call__(self, x: Tensor, module: nn.Linear) -> Tensor:
        packed = self._packed.get(module)
        if packed is None and self._lazy and _packable(module):
            packed = self._packed[module] = _Packed.of(module.weight)
        if packed is None or x.numel() < MIN_ROWS * x.shape[-1]:
            return F.linear(x, module.weight, module.bias)
        weight = module.weight
        if _version(weight) != packed.version:  # changed since it was packed: pack it again
            packed.weight, packed.version = _pack(weight), _version(weight)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed.weight, module.bias, "none", [], ""
        )


def _packable(module: nn.Module) -> bool:
    """A float32 CPU ``nn.Linear`` (exactly that class: a subclass has a forward of its own)."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and isinstance(weight, Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )
