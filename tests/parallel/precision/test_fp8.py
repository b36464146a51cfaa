"""fp8 Linear: quantisation error bounds, emulated vs torch._scaled_mm, recipes, filter, plugin.

Oracles: torch's own float8 casts (round-to-nearest-even) and ``torch._scaled_mm`` (runs on CPU
in torch 2.13), and ``F.linear`` in fp32 with fp8-sized tolerances.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.models import GPT, GPTConfig
from llmlab.models.linear import Linear
from llmlab.parallel.precision import Float8Linear, FP8Precision, convert_to_float8
from llmlab.parallel.precision.fp8 import E4M3, E5M2, dequantize, quantize, scale_from_amax
from tests.helpers.tiny import quiet_trainer


@pytest.mark.parametrize("dtype, mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantize_round_trip_error_is_half_an_ulp(dtype: torch.dtype, mantissa_bits: int) -> None:
    x = torch.randn(4096) * 3
    s = scale_from_amax(x.abs().max(), dtype)
    back = dequantize(quantize(x, s, dtype), s)
    big = x.abs() > x.abs().max() / 64  # normal range of the scaled values
    rel = ((back - x).abs() / x.abs())[big]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-7
    assert back.abs().max() == pytest.approx(x.abs().max(), rel=2.0 ** -(mantissa_bits + 1))


def test_quantize_saturates_instead_of_overflowing() -> None:
    s = torch.tensor(1.0)
    q = quantize(torch.tensor([1e6, -1e6]), s, E4M3)
    assert torch.isfinite(q.float()).all() and q.float().tolist() == [448.0, -448.0]


def make(backend: str, recipe: str = "dynamic", seed: int = 0) -> tuple[nn.Linear, Float8Linear]:
    torch.manual_seed(seed)
    ref = nn.Linear(64, 48)
    fp8 = Float8Linear.from_linear(ref, recipe=recipe, backend=backend)
    assert fp8.weight is ref.weight and fp8.bias is ref.bias  # shared Parameters
    return ref, fp8


def test_forward_and_backward_close_to_fp32_linear() -> None:
    ref, fp8 = make("emulate")
    x = torch.randn(8, 16, 64, requires_grad=True)
    y, y_ref = fp8(x), ref(x)
    rel = (y - y_ref).norm() / y_ref.norm()
    assert rel < 0.05  # e4m3: ~2**-4 per operand, averaged over K=64 products
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, fp8.weight), g)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, ref.weight), g)
    assert (gx - gx_ref).norm() / gx_ref.norm() < 0.1  # e5m2 gradients: 2 mantissa bits
    assert (gw - gw_ref).norm() / gw_ref.norm() < 0.1


def test_scaled_mm_backend_equals_emulation() -> None:
    """Same fp8 operands, same scales: torch._scaled_mm and dequantise-then-matmul agree."""
    _, emu = make("emulate")
    _, smm = make("scaled_mm")
    x = torch.randn(32, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = emu(xa), smm(xb)
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ya)
    ga = torch.autograd.grad(ya, (xa, emu.weight), g)
    gb = torch.autograd.grad(yb, (xb, smm.weight), g)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 21, 40])
def test_scaled_mm_pads_a_token_count_that_is_no_multiple_of_16(tokens: int) -> None:
    """The weight gradient's inner dimension is the token count, which CUDA's _scaled_mm wants
    a multiple of 16: fp8_mm pads it with zeros. Here (CPU _scaled_mm) the padded products must
    still equal the emulation; the CUDA refusal itself is the gpu test below."""
    _, emu = make("emulate")
    _, smm = make("scaled_mm")
    x = torch.randn(tokens, 64)
    grad = torch.randn(tokens, 48)
    for a, b in zip(outputs_and_grads(emu, x, grad), outputs_and_grads(smm, x, grad), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def outputs_and_grads(layer: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
    """``layer(x)`` and the gradients of ``x`` and ``layer.weight`` for output gradient ``grad``
    (in the output's dtype: bf16 under autocast)."""
    x = x.clone().requires_grad_()
    y = layer(x)
    return (y, *torch.autograd.grad(y, (x, layer.weight), grad.to(y.dtype)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 21, 100])
def test_fp8_tensor_cores_train_any_token_count(tokens: int, dtype: torch.dtype) -> None:
    """On a GPU with fp8 tensor cores (the ``auto`` backend picks ``_scaled_mm``) forward and
    both gradients for token counts that are no multiple of 16, against the emulation. The
    tolerance is the tensor cores' accumulation, not the padding: on an H200 ``_scaled_mm``
    is ~1e-4 from the exact product (norm-relative; 2.5e-3 under bf16 autocast), where the
    emulation is ~1e-7."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9 or newer")
    torch.manual_seed(tokens)
    ref = nn.Linear(128, 256).cuda()
    emu = Float8Linear.from_linear(ref, backend="emulate")
    smm = Float8Linear.from_linear(ref, backend="auto")
    x = torch.randn(tokens, 128, device="cuda")
    grad = torch.randn(tokens, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        want = outputs_and_grads(emu, x, grad)
        got = outputs_and_grads(smm, x, grad)
    for a, b in zip(want, got, strict=True):
        rel = ((b.float() - a.float()).norm() / a.float().norm()).item()
        assert rel < 1e-2, (tokens, dtype, rel)


def test_delayed_scaling_uses_the_amax_history() -> None:
    _, fp8 = make("emulate", recipe="delayed")
    fp8(torch.full((4, 64), 2.0))  # history: amax 2
    assert fp8.input_amax.history[0] == 2.0
    # Now a 10× larger input: the delayed scale still comes from amax 2, so it saturates at
    # 448/s = 2 (what delayed scaling trades for not waiting on the current amax).
    s = fp8.input_amax.scale_for(torch.full((4, 64), 20.0))
    assert s == scale_from_amax(torch.tensor(2.0), E4M3)
    assert fp8.input_amax.history[:2].tolist() == [20.0, 2.0]
    dyn = make("emulate", recipe="dynamic")[1].input_amax.scale_for(torch.full((4, 64), 20.0))
    assert dyn == scale_from_amax(torch.tensor(20.0), E4M3)


def test_filter_converts_big_layers_and_skips_lm_head_and_small_ones() -> None:
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128))
    names = convert_to_float8(model, min_features=128)
    assert names == [
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    assert type(model.head.lm_head) is Linear  # the models' own linear layer, not converted
    assert model.head.lm_head.weight is model.embed.wte.weight  # tying untouched
    tiny = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32))
    assert convert_to_float8(tiny, min_features=128) == []
    with pytest.raises(ValueError, match="recipe 'jit'"):
        Float8Linear(16, 16, recipe="jit")
    with pytest.raises(ValueError, match="backend 'cuda'"):
        FP8Precision(backend="cuda")


def test_fp8_plugin_trains_in_lightning() -> None:
    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=64)
            self.model = GPT(cfg)
            self.losses: list[float] = []

        def training_step(self, batch, idx):
            x = batch[0][:, :-1]
            loss = F.cross_entropy(self.model(x).flatten(0, 1), batch[0][:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    data = torch.arange(17).repeat(8, 1) % 32  # a fixed pattern: learnable in a few steps
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    plugin = FP8Precision(min_features=64, backend="emulate")
    module = LM()
    quiet_trainer(max_steps=20, plugins=[plugin]).fit(module, loader)
    assert plugin.converted == [f"model.blocks.0.{m}" for m in ("attn.qkv", "attn.proj", "mlp.fc",
                                                                 "mlp.proj")]  # fmt: skip
    assert isinstance(module.model.blocks[0].mlp.fc, Float8Linear)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert module.losses[-1] < 0.5 * module.losses[0]
