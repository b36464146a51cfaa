"""How an MoE layer's rows travel: the expert products over rows sorted by expert, and the
gather into that order and the weighted combine back, each with a backward that is a
permutation and a sum (deterministic, no atomics). :mod:`llmlab.models.moe` is the layer that
routes and calls these; its docstring's **Dispatch** walks through an example.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def grouped_mm_supported(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs ``x @ weight[e].T`` here: present in
    this torch, rows of a whole number of 16-byte units, bf16 on CUDA (any float on CPU, but not
    under ``torch.compile``: its shape function accepts bf16 only, as CUDA's kernel does)."""
    if not HAS_GROUPED_MM or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.dtype != torch.bfloat16 and (x.device.type == "cuda" or torch.compiler.is_compiling()):
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    size = x.element_size()
    return (weight.shape[-1] * size) % 16 == 0 and (weight.shape[-2] * size) % 16 == 0


def segment_matmul(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """``x`` (M, in) sorted by expert, ``counts[e]`` rows each; ``weight`` (E, out, in):
    row block ``e`` times ``weight[e].T`` (the fallback of :func:`grouped_matmul`). The
    experts' weights come from one ``unbind``, whose backward stacks their gradients once;
    indexing ``weight[e]`` would build a full ``(E, out, in)`` gradient per expert and sum them
    (~1.4x slower forward + backward on CPU at 8 experts)."""
    weights = weight.unbind(0)
    parts = [blk @ weights[e].t() for e, blk in enumerate(torch.split(x, counts)) if blk.shape[0]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """``x`` (M, in), rows sorted by expert with ``counts`` (E,) rows per expert;
    ``weight`` (E, out, in): each row times its expert's ``weight[e].T`` -> (M, out)."""
    if grouped_mm_supported(x, weight):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    return segment_matmul(x, weight, counts.tolist())


class _DispatchRows(torch.autograd.Function):
    """``x[order // k]`` whose backward brings each row's gradient back to its ``(token, slot)``
    and sums the ``k`` slots, instead of autograd's accumulating scatter."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.shape = (x.shape[0], k, x.shape[-1])
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (order,) = ctx.saved_tensors
        N, k, C = ctx.shape
        # every slot written unless a capacity dropped some: those stay zero
        slots = grad.new_empty(N * k, C) if order.numel() == N * k else grad.new_zeros(N * k, C)
        slots.index_copy_(0, order, grad.contiguous())
        return slots.view(N, k, C).sum(dim=1), None, None


def dispatch_rows(x: Tensor, order: Tensor, k: int) -> Tensor:
    """The token rows of the assignments ``order`` (ids ``token * k + slot``): ``x[order // k]``.
    Its backward is a permutation into the ``(token, slot)`` layout and a sum over the ``k``
    slots: deterministic on every device, and on CPU ~10× faster than the accumulating
    ``index_put`` autograd gives ``x[idx]`` (a token appears ``k`` times in ``idx``)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _DispatchRows.apply(x, order, k)
    return x.index_select(0, order // k)  # no graph to build (decoding): no Function overhead


class _CombineRows(torch.autograd.Function):
    """Each row of ``y`` into its ``(token, slot)``, then the weighted sum over the slots."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, weights: Tensor, order: Tensor) -> Tensor:
        N, k = weights.shape
        C = y.shape[-1]
        # one row per (token, slot); a slot a capacity dropped stays zero
        slots = y.new_empty(N * k, C) if order.numel() == N * k else y.new_zeros(N * k, C)
        slots.index_copy_(0, order, y)
        slots = slots.view(N, k, C)
        weights = weights.to(y.dtype)
        if ctx is not None:
            ctx.save_for_backward(weights, slots, order)
        # in y's dtype, as the elementwise weighting it replaces: autocast would make it bf16
        with torch.autocast(y.device.type, enabled=False):
            return torch.bmm(weights.unsqueeze(1), slots).squeeze(1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        weights, slots, order = ctx.saved_tensors
        k = slots.shape[1]
        grad = grad.to(slots.dtype).contiguous()
        grad_y = grad.index_select(0, order // k)  # each row: its token's gradient ...
        grad_y.mul_(weights.reshape(-1)[order].unsqueeze(-1))  # ... times its weight
        grad_weights = torch.bmm(slots, grad.unsqueeze(-1)).squeeze(-1)  # dropped slots: 0
        return grad_y, grad_weights, None


def combine_rows(y: Tensor, weights: Tensor, order: Tensor) -> Tensor:
    """Token ``t``'s output ``Σ_j weights[t, j] · y[row of assignment t·k + j]`` from the rows
    ``y`` of the assignments ``order`` (sorted by expert): a permutation into the ``(token,
    slot)`` layout and one batched ``(1, k) @ (k, C)`` product per token, which weighs and sums
    at once; the backward is a gather and the same product, deterministic, no atomics."""
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        return _CombineRows.apply(y, weights, order)
    return _CombineRows.forward(None, y, weights, order)  # no graph to build: the same product
