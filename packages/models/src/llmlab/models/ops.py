"""The handful of ops the models need, from PyTorch or from llmlab.kernels (``config.kernels``).

Keeping the choice in one small table means the model code never branches on the backend, and a
kernel can be swapped in op by op. Tables: ``"torch"`` (PyTorch's ops), ``"triton"`` (llmlab's
Triton kernels, for CUDA) and ``"cpu"`` (llmlab's C++ CPU kernels where one exists, fused
SwiGLU so far; PyTorch's ops for the rest and wherever the kernel does not apply). GPT uses
``layer_norm``, ``gelu`` and ``attention``; Llama uses ``rms_norm``, ``rope``, ``swiglu`` and
``attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.kernels.attention import document_mask
from llmlab.kernels.rope import reference as _rope_reference


class AttentionFn(Protocol):
    """q (B, H, T, D), k and v (B, H_kv, S, D) with H_kv dividing H (grouped-query attention).

    ``document_ids`` (B, T), passed only when training on packed documents: each query sees the
    earlier keys of its own document only (block-diagonal causal attention)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = True,
        dropout_p: float = 0.0,
        document_ids: Tensor | None = None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class Ops:
    name: str
    layer_norm: object  # (x, weight, bias, eps) -> Tensor
    gelu: object  # (x) -> Tensor, tanh approximation (GPT-2's gelu_new)
    attention: AttentionFn  # (q, k, v, causal, dropout_p[, document_ids]), q/k/v (B, H, T, D)
    rms_norm: object  # (x, weight, eps) -> Tensor, HF LlamaRMSNorm's arithmetic
    rope: object  # (q, k, cos, sin) -> (q, k); q/k (B, T, H, D), cos/sin (B|1, T, D/2)
    swiglu: object  # (a, b) -> silu(a) * b


def _torch_layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _torch_gelu(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _torch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    document_ids: Tensor | None = None,
) -> Tensor:
    gqa = q.shape[1] != k.shape[1]  # SDPA indexes the shared KV heads itself
    if document_ids is not None:  # block-diagonal causal: an explicit (B, 1, T, T) mask
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=document_mask(document_ids), dropout_p=dropout_p, enable_gqa=gqa
        )
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa
    )


def _torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # HF's LlamaRMSNorm step by step (statistics in fp32, rounded before the weight), so that
    # logits match transformers to the last bits in any dtype; fp64 stays fp64.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rope_reference(q, k, cos, sin)  # HF's apply_rotary_pos_emb, op for op


def _torch_swiglu(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


def _triton_ops() -> Ops:
    from llmlab import kernels
    from llmlab.kernels import interpreter_requested

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = True,
        dropout_p: float = 0.0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        if dropout_p > 0.0:  # the fused kernel has no dropout: keep training semantics exact
            return _torch_attention(q, k, v, causal, dropout_p, document_ids)
        return kernels.attention(q, k, v, causal=causal, document_ids=document_ids)

    def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        return kernels.layer_norm(x, weight, bias, eps)

    ops = dict(
        layer_norm=layer_norm,
        gelu=kernels.gelu,
        attention=attention,
        rms_norm=kernels.rms_norm,
        rope=kernels.rope,
        swiglu=kernels.swiglu,
    )
    if interpreter_requested():  # Triton's interpreter is Python dynamo cannot trace: under
        # torch.compile each interpreted kernel is a graph break, run as in an eager step
        ops = {name: torch.compiler.disable(fn) for name, fn in ops.items()}
    return Ops("triton", **ops)


TORCH_OPS = Ops(
    "torch",
    layer_norm=_torch_layer_norm,
    gelu=_torch_gelu,
    attention=_torch_attention,
    rms_norm=_torch_rms_norm,
    rope=_torch_rope,
    swiglu=_torch_swiglu,
)


def _cpu_ops() -> Ops:
    """PyTorch's table with llmlab's C++ CPU kernels where one exists (SwiGLU)."""
    from llmlab.kernels.cpu_swiglu import cpu_swiglu

    return replace(TORCH_OPS, name="cpu", swiglu=cpu_swiglu)


def count_modules_using(model: torch.nn.Module, name: str) -> int:
    """How many submodules of ``model`` compute with the op table ``name`` (their ``ops``)."""
    return sum(getattr(getattr(m, "ops", None), "name", None) == name for m in model.modules())


def get_ops(name: str) -> Ops:
    """The op table for ``config.kernels``: ``"torch"``, ``"triton"`` or ``"cpu"``."""
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        return _triton_ops()
    if name == "cpu":
        return _cpu_ops()
    raise ValueError(f"unknown kernels backend {name!r}; valid: ['torch', 'triton', 'cpu']")
