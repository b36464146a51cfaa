"""Weight-only quantization: each product computes what it claims (``x @ dequantize(W).T`` in
fp32, within 1e-4 relative), packing round-trips, the model keeps one forward, decoding and the
engine run on it, and bad schemes are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmlab.decoding import generate
from llmlab.models import GPT, GPTConfig, Llama, LlamaConfig, QuantizedLinear, quantize
from llmlab.models.quantize import (
    QuantizedEmbedding,
    Scheme,
    dequantize,
    pack,
    parse_scheme,
    unpack,
    weight_bytes,
)

SCHEMES = ["bf16", "int8", "int4", "int4:g64", "int4:g128"]
REL = 1e-4  # relative to the product's largest entry: fp32 summation order only


def _gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    return GPT(cfg).eval()


def _llama() -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=128, intermediate_size=256, tie_embeddings=True)  # fmt: skip
    return Llama(cfg).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_product_equals_x_times_the_dequantized_weight(scheme, rows):
    """One or two rows go through the packed reduction, more through the widened weight: both
    equal the fp32 product with the dequantized weight."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 96)
    q = QuantizedLinear.from_linear(linear, parse_scheme(scheme))
    x = torch.randn(rows, 256)
    want = x.double() @ q.dequantize(torch.float64).T + linear.bias.detach().double()
    with torch.no_grad():
        got = q(x)
    assert got.dtype == x.dtype and got.shape == (rows, 96)
    assert _rel(got.double(), want) < REL


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4:g64"])
def test_packing_bounds_the_error_and_unpacks_exactly(scheme):
    """|w - dequantize(w)| is at most half a step of its scale (per row or group) -- a whole
    step for int4 values clamped at +7 (where a group's step puts its extreme at -8, a value of
    the opposite sign and nearly its size rounds to +8) --, no int4 group's squared error
    exceeds the symmetric rule's (max|w|/7), and re-packing the dequantized weight gives the
    same values (int8: the same bytes)."""
    s = parse_scheme(scheme)
    w = torch.randn(32, 128)
    data, scales = pack(w, s)
    back = unpack(data, scales, s, torch.float32)
    error = (w - back).abs()
    if s.kind == "int8":
        assert bool((error <= scales[:, None] / 2 + 1e-6).all())
    else:
        step = scales.abs().repeat_interleave(s.group, dim=1)
        clamped = (back / scales.repeat_interleave(s.group, dim=1)).round() == 7
        assert bool((error <= torch.where(clamped, step, step / 2) + 1e-6).all())
        groups = w.view(32, -1, s.group)
        plain = groups.abs().amax(dim=2, keepdim=True) / 7
        symmetric = (torch.round(groups / plain).clamp(-7, 7) * plain - groups).square().sum(2)
        ours = error.view(32, -1, s.group).square().sum(2)
        assert bool((ours <= symmetric * (1 + 1e-5)).all())  # (rounding of the two sums)
    again, rescaled = pack(back, s)  # quantizing a quantized weight loses nothing more
    if s.kind == "int8":
        assert torch.equal(again, data)
    torch.testing.assert_close(unpack(again, rescaled, s, torch.float32), back, atol=1e-6, rtol=0)


def test_input_gradients_flow_through_a_frozen_quantized_layer():
    """The frozen-base use (adapters in training): d(loss)/dx equals the dequantized weight's."""
    linear = nn.Linear(64, 32)
    q = QuantizedLinear.from_linear(linear, Scheme("int8"))
    x = torch.randn(2, 64, requires_grad=True)
    q(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, q.dequantize(), linear.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert not list(q.parameters())  # nothing to train: buffers only


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_a_quantized_model_has_one_forward_and_decodes_like_it(make, scheme):
    """The quantized model is the same modules with other linear layers: its cached decode
    (one-row products) equals its full forward (several rows), and generate runs on it."""
    model = quantize(make(), scheme)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(1, 20)
        steps = [model(ids[:, :6], attention=cache)]
        steps += [model(ids[:, t : t + 1], attention=cache) for t in range(6, 14)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
        out = generate(model, ids, max_new_tokens=5)
    assert out.shape == (1, 19)


def test_weights_shrink_and_tied_weights_stay_tied():
    """int8 holds about a quarter of fp32's bytes (norms and scales stay fp32), int4 less; a
    tied embedding and LM head share one quantized table."""
    fp32 = _llama()
    base = weight_bytes(fp32)
    sizes = {s: weight_bytes(quantize(copy.deepcopy(fp32), s)) / base for s in SCHEMES}
    assert sizes["bf16"] < 0.51 and sizes["int8"] < 0.28 and sizes["int4"] < 0.17
    model = quantize(copy.deepcopy(fp32), "int8")
    assert isinstance(model.embed.tokens, QuantizedEmbedding)
    assert model.embed.tokens.data is model.head.lm_head.data


@pytest.mark.parametrize("build", [_gpt, _llama])
def test_int4_keeps_the_output_layer_in_int8(build):
    """Under int4 the LM head, and the embedding tied to it, are int8 (llama.cpp keeps its
    output tensor at more bits); every other layer is int4, and the product stays exact."""
    model = build()
    x = torch.randint(0, 256, (1, 12))
    quantized = quantize(copy.deepcopy(model), "int4:g64")
    head = quantized.head.lm_head
    assert str(head.scheme) == "int8"
    embedding = getattr(quantized.embed, "tokens", None) or quantized.embed.wte
    assert embedding.data is head.data  # still one table
    rest = [m for n, m in quantized.named_modules() if isinstance(m, QuantizedLinear)
            and not n.endswith("lm_head")]  # fmt: skip
    assert rest and all(str(m.scheme) == "int4:g64" for m in rest)
    with torch.no_grad():
        float_twin = dequantize(copy.deepcopy(quantized))
        assert _rel(quantized(x).double(), float_twin(x).double()) < REL


def test_bad_schemes_and_layers_are_refused_by_name():
    for bad in ["int3", "int4:g48", "int4:64", "fp8", ""]:
        with pytest.raises(ValueError, match=r"is not a scheme; valid: bf16, int8, int4"):
            parse_scheme(bad)

    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(32, 32), Custom(32, 32))
    with pytest.raises(ValueError, match=r"cannot convert 1 \(Custom\)"):
        quantize(model, "int8")
    with pytest.raises(ValueError, match=r"0 has 40 inputs, not a multiple of int4's group 32"):
        quantize(nn.Sequential(nn.Linear(40, 8)), "int4")
