"""Llama's kernels under the interpreter: RMSNorm, RoPE on q and k, SwiGLU, and flash attention
with grouped-query heads; then a Llama with ``kernels="triton"`` against ``kernels="torch"``.

Oracles: the same math in float64 with torch autograd (HF's formulas: ``w·x·rsqrt(mean(x²)+eps)``,
``apply_rotary_pos_emb``'s rotate-half, ``F.silu(a)·b``) and ``F.scaled_dot_product_attention``
with ``enable_gqa=True``, rounded to the test dtype. Tolerances, per dtype, cover rounding the
kernel's fp32 result once to the output dtype: fp32 atol/rtol 1e-5, fp16 2e-3 (2 eps), bf16
1.6e-2 (2 eps); gradients of fp16/bf16 get 2x that (two roundings: the upstream gradient and the
result). Attention keeps test_attention.py's bounds (P is rounded before P·V). gradcheck runs the
Triton kernels themselves in float64 (fast mode, its default tolerances). Shapes are chosen not
to be multiples of the block sizes (rows of 37 and 100, 1,000- and 3,001-element SwiGLU inputs
against 1,024-wide blocks, 3 heads, half dims of 3 and 5, sequence lengths 19 and 37).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import attention, rms_norm, rope, swiglu
from llmlab.kernels._runtime import reset_fallback_warnings
from llmlab.models import Llama, LlamaConfig

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
GRAD_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3.2e-2, "rtol": 3.2e-2},
}
ATTN_TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
DTYPES = list(TOL)


def leaves(*tensors, dtype):
    """The same random values as a leaf of ``dtype`` and as a float64 leaf for the oracle."""
    low = [t.to(dtype).requires_grad_() for t in tensors]
    high = [t.detach().double().requires_grad_() for t in low]
    return low, high


def check_grads(got, want, dtype, names, sums=()):
    """``sums``: gradients that add up over rows (a weight's), allowed sqrt(rows) more error."""
    for name, g, g64 in zip(names, got, want):
        tol = GRAD_TOL[dtype]
        if name in sums:
            tol = {k: v * sums[name] ** 0.5 * 4 for k, v in tol.items()}
        torch.testing.assert_close(g, g64.to(dtype), **tol, msg=lambda m, n=name: f"d{n}: {m}")


# -------------------------------------------------------------------------------- RMSNorm
def rms_norm64(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 100)])
def test_rms_norm_forward_backward(shape, dtype):
    C = shape[-1]
    (x, w), (x64, w64) = leaves(torch.randn(shape) * 2 + 0.5, torch.randn(C), dtype=dtype)
    y = rms_norm(x, w, 1e-6)
    y64 = rms_norm64(x64, w64, 1e-6)
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(y64, (x64, w64), dy.double())
    check_grads(got, want, dtype, "xw", sums={"w": dy.numel() // C})


def test_rms_norm_gradcheck_float64():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: rms_norm(*a, 1e-6), (x, w), fast_mode=True)


# ----------------------------------------------------------------------------------- RoPE
def rope64(q, k, cos, sin):
    """HF's apply_rotary_pos_emb in the (B, T, H, D) layout: x·cos + rotate_half(x)·sin."""
    cos = torch.cat((cos, cos), -1).unsqueeze(2)
    sin = torch.cat((sin, sin), -1).unsqueeze(2)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# (B, T, Hq, Hk, D, one cos table for the whole batch?)
ROPE_CASES = [(2, 5, 4, 2, 6, False), (1, 19, 3, 1, 10, True), (3, 7, 2, 2, 16, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_forward_backward(case, dtype):
    B, T, Hq, Hk, D, shared = case
    positions = torch.randint(0, 50, (1 if shared else B, T)).double()
    angles = positions[..., None] * 10000.0 ** (-torch.arange(0, D, 2).double() / D)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    (q, k), (q64, k64) = leaves(torch.randn(B, T, Hq, D), torch.randn(B, T, Hk, D), dtype=dtype)
    out = rope(q, k, cos, sin)
    ref = rope64(q64, k64, cos.double(), sin.double())
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r.to(dtype), **TOL[dtype])
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got = torch.autograd.grad(out, (q, k), (dq, dk))
    want = torch.autograd.grad(ref, (q64, k64), (dq.double(), dk.double()))
    check_grads(got, want, dtype, "qk")


def test_rope_gradcheck_float64():
    q = torch.randn(2, 5, 3, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 6, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(2, 5, 3, dtype=torch.float64)
    fn = lambda q, k: rope(q, k, angles.cos(), angles.sin())  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k), fast_mode=True)


# --------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 250), (3001,)])
def test_swiglu_forward_backward(shape, dtype):
    (a, b), (a64, b64) = leaves(torch.randn(shape) * 3, torch.randn(shape), dtype=dtype)
    y = swiglu(a, b)
    y64 = F.silu(a64) * b64
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    got = torch.autograd.grad(y, (a, b), dy)
    want = torch.autograd.grad(y64, (a64, b64), dy.double())
    check_grads(got, want, dtype, "ab")


def test_swiglu_extremes_and_gradcheck_float64():
    # sigmoid from exp(-|a|): no overflow at either end (silu(-100) is a denormal, -3.7e-42)
    a = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])
    torch.testing.assert_close(swiglu(a, torch.ones(5)), F.silu(a), atol=1e-38, rtol=1e-6)
    a = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (a, b), fast_mode=True)


# -------------------------------------------------------------------- attention with GQA
# (B, H, H_kv, L, S, D): two and three query heads per KV head, lengths off the 16-wide tiles.
GQA_CASES = [(1, 4, 2, 37, 37, 24), (2, 3, 1, 19, 19, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", GQA_CASES)
def test_gqa_attention_matches_sdpa(case, causal, dtype):
    B, H, Hkv, L, S, D = case
    (q, k, v), (q64, k64, v64) = leaves(
        torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), dtype=dtype
    )
    out = attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, ref.to(dtype), **ATTN_TOL[dtype])
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, g, g64 in zip("qkv", got, want):
        assert g.shape == g64.shape  # dK, dV per KV head: summed over its group
        torch.testing.assert_close(
            g, g64.to(dtype), **ATTN_TOL[dtype], msg=lambda m, n=name: f"d{n}: {m}"
        )


def test_gqa_attention_gradcheck_float64():
    q = torch.randn(1, 4, 6, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    fn = lambda *a: attention(*a, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


# ------------------------------------------------------------------------ the whole model
def loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_llama_triton_kernels_match_torch_ops():
    """Done-when 3: every op of a GQA Llama (RMSNorm, RoPE, SwiGLU, attention) runs its Triton
    kernel; loss atol 1e-5, every gradient atol 1e-5 / rtol 1e-4 (fp32, 2 layers, d=32: the
    kernels sum in a different order than torch's CPU ops)."""
    common = dict(
        vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
        intermediate_size=40,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = Llama(LlamaConfig(**common, kernels="torch"))
    fused = Llama(LlamaConfig(**common, kernels="triton"))
    fused.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 64, (2, 13))
    targets = torch.randint(0, 64, (2, 13))

    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_k, grads_k = loss_and_grads(fused, ids, targets)
    fallbacks = [w for w in caught if "llmlab.kernels" in str(w.message)]
    assert not fallbacks, f"the reference ran instead of the kernels: {fallbacks[0].message}"

    loss_t, grads_t = loss_and_grads(ref, ids, targets)
    torch.testing.assert_close(loss_k, loss_t, atol=1e-5, rtol=0)
    assert grads_k.keys() == grads_t.keys()
    for name in grads_t:
        torch.testing.assert_close(
            grads_k[name], grads_t[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
