"""The handful of ops a GPT needs, from PyTorch or from llmlab.kernels (``GPTConfig.kernels``).

Keeping the choice in one small table means the model code never branches on the backend, and a
kernel can be swapped in op by op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor


class AttentionFn(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0
    ) -> Tensor: ...


@dataclass(frozen=True)
class Ops:
    name: str
    layer_norm: object  # (x, weight, bias, eps) -> Tensor
    gelu: object  # (x) -> Tensor, tanh approximation (GPT-2's gelu_new)
    attention: AttentionFn  # (q, k, v, causal, dropout_p) with q/k/v of shape (B, H, T, D)


def _torch_layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _torch_gelu(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _torch_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0
) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)


def _triton_ops() -> Ops:
    from llmlab import kernels

    def attention(
        q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0
    ) -> Tensor:
        if dropout_p > 0.0:  # the fused kernel has no dropout: keep training semantics exact
            return _torch_attention(q, k, v, causal, dropout_p)
        return kernels.attention(q, k, v, causal=causal)

    def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        return kernels.layer_norm(x, weight, bias, eps)

    return Ops("triton", layer_norm, kernels.gelu, attention)


TORCH_OPS = Ops("torch", _torch_layer_norm, _torch_gelu, _torch_attention)


def get_ops(name: str) -> Ops:
    """The op table for ``GPTConfig.kernels``: ``"torch"`` or ``"triton"``."""
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        return _triton_ops()
    raise ValueError(f"unknown kernels backend {name!r}; valid: ['torch', 'triton']")
