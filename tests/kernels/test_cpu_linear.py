"""The few-row fp32 product (``llmlab.kernels.cpu_linear``) and the models' ``Linear``.

Oracle: ``F.linear`` in float64 (the kernel's sums run in another order than MKL's, so the
comparison is to fp32 rounding, 1e-6 of the largest output), on shapes with and without tails
after the vector loop and one split across threads. What the kernel promises beyond that: a
row's result does not depend on how many rows it is computed with (each output's sum runs in the
same order for any number of rows up to ``MAX_ROWS``), and every case it does not take is
exactly ``F.linear``'s (autograd, more rows, other dtypes), compiled or not; a compiled graph
calls the kernel as one op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from llmlab.kernels.cpu_extension import cpu_kernels
from llmlab.kernels.cpu_linear import MAX_ROWS, kernel_applies, linear
from llmlab.models import GPT, GPTConfig, Linear, quantize
from llmlab.models.quantize import QuantizedLinear

needs_kernel = pytest.mark.skipif(
    cpu_kernels() is None, reason="llmlab's C++ CPU kernels are not built here (no AVX2/compiler)"
)
SHAPES = [(7, 5), (33, 17), (50, 64), (300, 160), (4099, 768)]  # (out, in)


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_equals_float64_linear_to_fp32_rounding(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    assert kernel_applies(x, w, b)
    got = linear(x, w, b)
    want = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MAX_ROWS, 768, generator=g)
    w, b = torch.randn(2304, 768, generator=g), torch.randn(2304, generator=g)
    alone = torch.cat([linear(x[i : i + 1], w, b) for i in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(linear(x[:rows], w, b), alone[:rows])


@needs_kernel
def test_leading_dimensions_are_flattened_and_restored():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 40, generator=g), torch.randn(24, 40, generator=g)
    assert kernel_applies(x, w)
    got, want = linear(x, w), F.linear(x.double(), w.double())
    assert got.shape == (2, 3, 24)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6


def test_what_the_kernel_does_not_take_is_f_linear_exactly():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    many = torch.randn(MAX_ROWS + 1, 32, generator=g)
    assert not kernel_applies(many, w, b)
    assert torch.equal(linear(many, w, b), F.linear(many, w, b))
    half = torch.randn(2, 32, generator=g).bfloat16()
    assert not kernel_applies(half, w.bfloat16())
    assert torch.equal(linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))
    strided = torch.randn(32, 2, generator=g).t()
    assert not kernel_applies(strided, w)
    # autograd: the kernel has no backward, so a product that needs one is F.linear's
    x = torch.randn(2, 32, generator=g, requires_grad=True)
    assert not kernel_applies(x, w, b)
    linear(x, w, b).sum().backward()
    expected = torch.ones(2, 64) @ w
    assert torch.equal(x.grad, expected)
    with torch.no_grad():
        assert kernel_applies(x, w, b) == (cpu_kernels() is not None)


@needs_kernel
def test_autocast_and_dispatch_modes_see_f_linear():
    """The kernel is an opaque call: under CPU autocast F.linear computes in bf16, and a FLOP
    counter counts the product; both must hold as they do without the kernel."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(2, 32), torch.randn(16, 32)
    assert kernel_applies(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernel_applies(x, w)
        assert linear(x, w).dtype == F.linear(x, w).dtype == torch.bfloat16
    with FlopCounterMode(display=False) as counter:
        linear(x, w)
    assert counter.get_total_flops() == 2 * 2 * 32 * 16


@needs_kernel
def _compiled_calls(layer: nn.Module, x: Tensor) -> tuple[Tensor, list]:
    """``layer(x)`` compiled whole (no graph break) and the functions its graph calls."""
    counter = CompileCounterWithBackend("inductor")
    out = torch.compile(layer, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1
    return out, [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
def test_a_compiled_graph_calls_the_kernel_as_one_op(rows):
    layer = Linear(32, 16)
    x = torch.randn(rows, 32)
    with torch.no_grad():
        out, calls = _compiled_calls(layer, x)
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert torch.ops.llmlab.fp32_few_row_product.default in calls
    assert float((out - want).abs().max() / want.abs().max()) < 1e-6


@pytest.mark.parametrize("case", ["grad", "rows", "bf16"])
def test_a_compiled_graph_leaves_other_products_to_inductor(case):
    layer = Linear(32, 16)
    x = torch.randn(MAX_ROWS + 1 if case == "rows" else 2, 32, requires_grad=case == "grad")
    if case == "bf16":
        layer, x = layer.bfloat16(), x.bfloat16()
    with torch.set_grad_enabled(case == "grad"):
        out, calls = _compiled_calls(layer, x)
    assert torch.ops.llmlab.fp32_few_row_product.default not in calls
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))


def test_models_linear_is_an_nn_linear_that_quantizes_and_round_trips():
    layer = Linear(32, 16)
    assert isinstance(layer, nn.Linear) and layer.plain_linear
    assert set(layer.state_dict()) == {"weight", "bias"}
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    assert type(model.blocks[0].mlp.fc) is Linear
    quantize(model, "int8")
    assert isinstance(model.blocks[0].mlp.fc, QuantizedLinear)


@needs_kernel
def test_gpt_decoding_logits_match_the_eager_products():
    """A model's forward at decode sizes through the kernel gives the logits of the same
    forward with every product through F.linear (kernel off)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        ours = model(ids)  # 5 rows: the kernel
        reference = model(ids.repeat(4, 1))[:1]  # 20 rows: F.linear everywhere
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
