"""Fused kernels under the interpreter vs torch.nn.functional (forward and backward).

The oracle is torch's own op evaluated in float64 with torch autograd, rounded to the test
dtype. Tolerances, per dtype, cover rounding the kernel's fp32 result once to the output dtype:
fp32 atol/rtol 1e-5 (values and gradients are O(1)), fp16 2e-3 (2 eps), bf16 1.6e-2 (2 eps);
gradients of fp16/bf16 get 2x that (two roundings: the upstream gradient and the result).
gradcheck runs the Triton kernels themselves in float64 (fast mode, its default tolerances).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import add3, add_layer_norm, bias_gelu, gelu, layer_norm, softmax

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
DTYPES = list(TOL)
# Row lengths that are not powers of two (the row kernels pad to the next one and mask).
SHAPES = [(3, 5, 37), (7, 64), (2, 100)]


def leaves(*tensors, dtype):
    """The same random values as a leaf of ``dtype`` and as a float64 leaf for the oracle."""
    low = [t.to(dtype).requires_grad_() for t in tensors]
    high = [t.detach().double().requires_grad_() for t in low]
    return low, high


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


# ----------------------------------------------------------------------------------- GELU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_forward_backward(shape, dtype):
    (x,), (x64,) = leaves(torch.randn(shape) * 3, dtype=dtype)
    y = gelu(x)
    y64 = F.gelu(x64, approximate="tanh")
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    (dx,) = grads(y, [x], dy)
    (dx64,) = grads(y64, [x64], dy.double())
    torch.testing.assert_close(dx, dx64.to(dtype), **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_forward_backward(shape, dtype):
    (x, b), (x64, b64) = leaves(torch.randn(shape) * 2, torch.randn(shape[-1]), dtype=dtype)
    y = bias_gelu(x, b)
    y64 = F.gelu(x64 + b64, approximate="tanh")
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    dx, db = grads(y, [x, b], dy)
    dx64, db64 = grads(y64, [x64, b64], dy.double())
    torch.testing.assert_close(dx, dx64.to(dtype), **GRAD_TOL[dtype])
    # db sums dx over all rows: its error grows with the row count (bf16/fp16: dx is rounded).
    rows = dy.numel() // shape[-1]
    tol = {k: v * rows**0.5 for k, v in GRAD_TOL[dtype].items()}
    torch.testing.assert_close(db, db64.to(dtype), **tol)


def test_gelu_gradcheck_float64():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(bias_gelu, (x, b), fast_mode=True)
    assert torch.autograd.gradcheck(gelu, (x,), fast_mode=True)


# ------------------------------------------------------------------------------ LayerNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_forward_backward(shape, dtype):
    C = shape[-1]
    (x, w, b), (x64, w64, b64) = leaves(
        torch.randn(shape) * 2 + 0.5, torch.randn(C), torch.randn(C), dtype=dtype
    )
    y = layer_norm(x, w, b, 1e-5)
    y64 = F.layer_norm(x64, (C,), w64, b64, 1e-5)
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    got = grads(y, [x, w, b], dy)
    want = grads(y64, [x64, w64, b64], dy.double())
    rows = dy.numel() // C
    for name, g, g64 in zip("xwb", got, want):
        # dw, db are sums over rows: allow the row-count growth of rounding error.
        scale = 1.0 if name == "x" else rows**0.5
        tol = {k: v * scale * 4 for k, v in GRAD_TOL[dtype].items()}
        torch.testing.assert_close(g, g64.to(dtype), **tol, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_forward_backward(dtype):
    shape, C = (4, 6, 45), 45
    (x, r, w, b), (x64, r64, w64, b64) = leaves(
        torch.randn(shape), torch.randn(shape), torch.randn(C), torch.randn(C), dtype=dtype
    )
    y, z = add_layer_norm(x, r, w, b, 1e-5)
    z64 = x64 + r64
    y64 = F.layer_norm(z64, (C,), w64, b64, 1e-5)
    torch.testing.assert_close(z, z64.to(dtype), **TOL[dtype])
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    # Both outputs feed the loss, as in a pre-norm block (z is the next residual stream).
    gy, gz = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    got = torch.autograd.grad((y, z), (x, r, w, b), (gy, gz))
    want = torch.autograd.grad((y64, z64), (x64, r64, w64, b64), (gy.double(), gz.double()))
    rows = 24
    for name, g, g64 in zip(["x", "residual", "w", "b"], got, want):
        scale = 1.0 if name in ("x", "residual") else rows**0.5
        tol = {k: v * scale * 4 for k, v in GRAD_TOL[dtype].items()}
        torch.testing.assert_close(g, g64.to(dtype), **tol, msg=lambda m, n=name: f"d{n}: {m}")


def test_layer_norm_without_affine_matches_torch():
    x = torch.randn(5, 33, requires_grad=True)
    y = layer_norm(x, None, None)
    torch.testing.assert_close(y, F.layer_norm(x, (33,)), atol=1e-5, rtol=1e-5)


def test_layer_norm_gradcheck_float64():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: layer_norm(*a, 1e-5), (x, w, b), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda *a: add_layer_norm(*a, 1e-5), (x, r, w, b), fast_mode=True
    )


# -------------------------------------------------------------------------------- softmax
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 9, 9), (5, 37), (3, 20, 33)])
def test_softmax_forward_backward(shape, causal, dtype):
    (x,), (x64,) = leaves(torch.randn(shape) * 3, dtype=dtype)
    y = softmax(x, causal=causal)
    s64 = x64
    if causal:
        L, S = shape[-2:]
        s64 = x64.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    y64 = torch.softmax(s64, dim=-1)
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn(shape, dtype=dtype)
    (dx,) = grads(y, [x], dy)
    (dx64,) = grads(y64, [x64], dy.double())
    torch.testing.assert_close(dx, dx64.to(dtype), **GRAD_TOL[dtype])


def test_softmax_gradcheck_float64():
    x = torch.randn(2, 7, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax(t, causal=True), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda t: softmax(t), (x,), fast_mode=True)


# ------------------------------------------------------------------- elementwise chain
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1000, 3001])
def test_add3_matches_eager_chain(n, dtype):
    a, b, c = (torch.randn(n, dtype=dtype) for _ in range(3))
    # The kernel sums in fp32 and rounds once: the float64 sum rounded to the dtype, to 1 ulp.
    exact = (a.double() + b.double() + c.double()).to(dtype)
    torch.testing.assert_close(add3(a, b, c), exact, **TOL[dtype])


def test_empty_inputs_take_the_reference_path():
    """A zero-size tensor has nothing to launch: the ops return the (empty) reference result."""
    x = torch.empty(0, 7)
    assert gelu(x).shape == (0, 7)
    assert layer_norm(x, torch.ones(7), torch.zeros(7)).shape == (0, 7)
    assert softmax(x).shape == (0, 7)


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes_fp32(seed):
    """Random (seeded) row counts and widths through LayerNorm, bias-GELU and causal softmax."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 40, (1,), generator=g))
    C = int(torch.randint(1, 130, (1,), generator=g))
    (x, w, b), (x64, w64, b64) = leaves(
        torch.randn(R, C, generator=g),
        torch.randn(C, generator=g),
        torch.randn(C, generator=g),
        dtype=torch.float32,
    )
    pairs = [
        (layer_norm(x, w, b, 1e-5), F.layer_norm(x64, (C,), w64, b64, 1e-5), [x, w, b]),
        (bias_gelu(x, b), F.gelu(x64 + b64, approximate="tanh"), [x, b]),
        (
            softmax(x, causal=True),
            torch.softmax(
                x64.masked_fill(~torch.ones(R, C, dtype=torch.bool).tril(), -torch.inf), -1
            ),
            [x],
        ),
    ]
    for y, y64, inputs in pairs:
        torch.testing.assert_close(y, y64.float(), atol=1e-5, rtol=1e-5)
        dy = torch.randn(R, C, generator=g)
        got = torch.autograd.grad(y, inputs, dy)
        want = torch.autograd.grad(
            y64, [{id(x): x64, id(w): w64, id(b): b64}[id(t)] for t in inputs], dy.double()
        )
        for gk, gt in zip(got, want):
            torch.testing.assert_close(gk, gt.float(), atol=1e-4 * R**0.5, rtol=1e-4)
