"""QLoRA's memory: LoRA over a quantized Llama trains through the packed base.

The base's input gradients come from :class:`llmlab.kernels.quantized.QuantizedMatmul`, which
widens one layer's weight inside its own backward; the path it replaces (``reference``:
``F.linear`` on the widened weight under autograd) keeps every layer's full-precision weight
in the graph until the backward. Oracles: that widened path (every adapter gradient and the
input gradient equal within fp32 rounding, 1e-5 relative) and the graph's saved tensors,
counted through ``torch.autograd.graph.saved_tensors_hooks`` (bytes of distinct storages the
model does not already hold: a deterministic count, no timing, no allocator statistics)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from llmlab.kernels.quantized import reference
from llmlab.models import build_model
from llmlab.models.lora import LoRAConfig, apply_lora, count_parameters, lora_state_dict
from llmlab.models.quantize import (
    QuantizedLinear,
    dequantize,
    float_weight_bytes,
    weight_bytes,
)

# the module, not the function ``llmlab.models.quantize`` that the package exports under its name
quantize_module = importlib.import_module("llmlab.models.quantize")
SPEC = dict(arch="llama", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
            n_embd=64, intermediate_size=128)  # fmt: skip


def _model(quantize: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(SPEC)
    torch.manual_seed(1)
    model = apply_lora(model, LoRAConfig(r=4, alpha=8, quantize=quantize))
    with torch.no_grad():  # B non-zero, so that A's gradients are not zero
        for p in lora_state_dict(model).values():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """Forward + backward; the bytes of the distinct storages the graph saved that the model
    does not hold (activations, widened weights), and those tensors' shapes."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return sum(saved.values()), shapes


def _widened(monkeypatch):
    """The path QuantizedMatmul replaces: F.linear on the widened weight, under autograd."""
    monkeypatch.setattr(quantize_module, "quantized_matmul", reference)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gradients_equal_the_widened_path_and_no_widened_weight_is_kept(scheme, monkeypatch):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    packed = _model(scheme)
    widened = copy.deepcopy(packed)
    packed_bytes, packed_shapes = _step(packed, ids)
    with monkeypatch.context() as m:
        _widened(m)
        widened_bytes, widened_shapes = _step(widened, ids)
    theirs = lora_state_dict(widened)
    for key, p in lora_state_dict(packed).items():
        want = theirs[key].grad
        assert float((p.grad - want).abs().max() / want.abs().max()) < 1e-5, key
    assert not any(b.requires_grad for b in packed.buffers())

    # the widened path saves each base layer's (out, in) weight whose input carries a gradient
    # (every layer but block 0's q/k/v, whose input is the frozen embedding's output); the
    # packed path saves none, and its graph is smaller by at least those weights' fp32 bytes
    layers = [m for m in packed.modules() if isinstance(m, QuantizedLinear)]
    # F.linear on a 3-d input saves the weight transposed (a view of it): both orientations
    weights = {s for m in layers for s in ((m.out_features, m.in_features),
                                          (m.in_features, m.out_features))}  # fmt: skip
    assert not any(s in weights for s in packed_shapes)
    kept = [s for s in widened_shapes if s in weights]
    assert len(kept) == len(layers) - 3, kept
    assert widened_bytes - packed_bytes >= sum(4 * o * i for o, i in kept)


def test_a_packed_buffer_that_asks_for_a_gradient_is_refused():
    model = _model("int8")
    layer = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    layer.scales.requires_grad_()
    with pytest.raises(RuntimeError, match="a quantized layer is frozen"):
        model(torch.randint(0, 256, (1, 8)))


def test_lora_quantize_validates_its_scheme_and_quantizes_before_wrapping():
    with pytest.raises(ValueError, match=r"lora\.quantize='int3' is not a scheme"):
        LoRAConfig(quantize="int3")
    assert LoRAConfig(quantize="int4:g32").quantize == "int4"
    model = _model("int4:g64")
    assert count_parameters(model) == count_parameters(_model(None))  # the base counted whole
    adapted = [m.base_layer for m in model.modules() if hasattr(m, "base_layer")]
    assert adapted and all(isinstance(b, QuantizedLinear) for b in adapted)
    assert all(str(b.scheme) == "int4:g64" for b in adapted)
    # int4's group must divide every input width: refused before anything is converted
    odd = build_model({**SPEC, "intermediate_size": 96})
    with pytest.raises(ValueError, match="96 inputs, not a multiple of int4's group 64"):
        apply_lora(odd, LoRAConfig(quantize="int4:g64"))
    assert not any(isinstance(m, QuantizedLinear) for m in odd.modules())


def test_dequantize_gives_float_layers_computing_the_same_function():
    model = _model("int4")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids)
        before = float_weight_bytes(model)
        dequantize(model)
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        assert weight_bytes(model) == before
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)
