"""Row softmax over the last dimension, with an optional causal mask, and its backward.

Faces (docs/architecture.md#kernels-three-faces): :func:`reference` (``torch.softmax`` after filling
masked scores with ``-inf``), :func:`triton_forward` / :func:`triton_backward`, and the public
:func:`softmax`. With ``causal=True`` the last two dims are an (L, S) score matrix and row ``i``
keeps columns ``j <= i`` (top-left aligned, like ``scaled_dot_product_attention(is_causal=True)``).
"""

from __future__ import annotations

import torch

from llmlab.kernels._runtime import (
    FLOAT_DTYPES,
    check_float,
    compute_dtype,
    jit_module,
    next_power_of_2,
    use_triton,
)

MAX_S = 65536


def causal_mask(L: int, S: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean (L, S) mask, True where row i may attend to column j (j <= i)."""
    return torch.ones(L, S, dtype=torch.bool, device=device).tril()


def reference(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    if causal:
        L, S = x.shape[-2:]
        x = x.masked_fill(~causal_mask(L, S, x.device), float("-inf"))
    return torch.softmax(x, dim=-1)


def backward_reference(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``dx = y * (dy - sum(dy * y))``: the softmax Jacobian-vector product, row by row."""
    return y * (dy - (dy * y).sum(-1, keepdim=True))


def triton_forward(x: torch.Tensor, causal: bool) -> torch.Tensor:
    S = x.shape[-1]
    L = x.shape[-2] if x.dim() >= 2 else 1
    x = x.contiguous()
    y = torch.empty_like(x)
    jit_module("softmax").softmax_fwd_kernel[(x.numel() // S,)](
        x,
        y,
        L,
        S,
        CAUSAL=causal,
        COMPUTE=compute_dtype(x.dtype),
        BLOCK_S=next_power_of_2(S),
    )
    return y


def triton_backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    S = y.shape[-1]
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    jit_module("softmax").softmax_bwd_kernel[(y.numel() // S,)](
        dy, y, dx, S, COMPUTE=compute_dtype(y.dtype), BLOCK_S=next_power_of_2(S)
    )
    return dx


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, causal):
        y = triton_forward(x, causal)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return triton_backward(dy, y), None


def softmax(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Softmax over the last dim; ``causal=True`` masks column j > i of each (L, S) matrix."""
    check_float("softmax", "x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"softmax: x needs a non-empty last dimension, got {tuple(x.shape)}")
    if causal and x.dim() < 2:
        raise ValueError(f"softmax: causal=True needs x of shape (..., L, S), got {tuple(x.shape)}")
    if x.shape[-1] > MAX_S:
        raise ValueError(f"softmax: rows of {x.shape[-1]} exceed the {MAX_S} supported")
    if use_triton("softmax", x):
        return _Softmax.apply(x, causal)
    return reference(x, causal)
