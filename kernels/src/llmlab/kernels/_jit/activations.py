"""Device functions shared by several kernels: GELU (tanh form), SiLU, and their derivatives.

GPT-2's GELU is ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. ``tanh`` is written as
``sign(u) (1 - e) / (1 + e)`` with ``e = exp(-2|u|)`` because ``tl`` has no portable tanh
(libdevice is CUDA-only); ``e`` lies in (0, 1], so nothing overflows for any ``u``.
"""

import triton
import triton.language as tl

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


@triton.jit
def tanh(u):
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


@triton.jit
def gelu_tanh_grad(x):
    """d/dx gelu_tanh(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


@triton.jit
def sigmoid(x):
    """``1 / (1 + exp(-x))`` from ``e = exp(-|x|)`` in (0, 1]: nothing overflows for any ``x``."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def silu_grad(x):
    """d/dx x * s(x) = s + x s (1 - s) = s (1 + x (1 - s)), with s = sigmoid(x)."""
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))
