"""Megatron-LM's communication operators, each a tiny autograd Function named for what it does.

A tensor-parallel layer is ordinary math between two of these. Their forward and backward are
conjugate (the backward of a copy is a sum; of a split, a concatenation), which is why the
sharded model's gradients equal the single-process ones:

=========================================  ===========================  ===========================
mapping                                    forward                      backward
=========================================  ===========================  ===========================
``copy_to_tensor_region``       (``f``)    identity                     all-reduce
``reduce_from_tensor_region``   (``g``)    all-reduce                   identity
``scatter_to_tensor_region``               split last dim               all-gather last dim
``gather_from_tensor_region``              all-gather last dim          split last dim
``scatter_to_sequence_region``             split sequence               all-gather sequence
``gather_from_sequence_region``            all-gather sequence          reduce-scatter sequence
                                                                        (or split, see below)
``reduce_scatter_to_sequence_region``      reduce-scatter sequence      all-gather sequence
=========================================  ===========================  ===========================

The GPT's activations are (B, T, d), so the sequence dimension defaults to 1.

Under ``compile=true`` each mapping is a graph break (``torch.compiler.disable``): the collective
runs eagerly, as in an uncompiled step, and counts its bytes in the comm ledger there, while the
math between two mappings is compiled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.primitives import Group

SEQ_DIM = 1


class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return C.all_reduce(grad, ctx.group, "copy_to_tensor_region.backward"), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        return C.all_reduce(x, group, "reduce_from_tensor_region.forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return C.split(x, group, dim=-1, what="last")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return C.all_gather(grad, ctx.group, -1, "scatter_to_tensor_region.backward"), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return C.all_gather(x, group, -1, "gather_from_tensor_region.forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return C.split(grad, ctx.group, dim=-1), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return C.split(x, group, dim=dim, what="sequence")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        out = C.all_gather(grad, ctx.group, ctx.dim, "scatter_to_sequence_region.backward")
        return out, None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, dim: int, grad_is_partial: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.grad_is_partial = group, dim, grad_is_partial
        return C.all_gather(x, group, dim, "gather_from_sequence_region.forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.grad_is_partial:  # the consumer was a tensor-parallel layer: sum its partial grads
            tag = "gather_from_sequence_region.backward"
            return C.reduce_scatter(grad, ctx.group, ctx.dim, tag), None, None, None
        return C.split(grad, ctx.group, dim=ctx.dim), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return C.reduce_scatter(
            x, group, dim, "reduce_scatter_to_sequence_region.forward", what="sequence"
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        tag = "reduce_scatter_to_sequence_region.backward"
        return C.all_gather(grad, ctx.group, ctx.dim, tag), None, None


@torch.compiler.disable
def copy_to_tensor_region(x: Tensor, group: Group) -> Tensor:
    """Megatron's ``f``: enter a tensor-parallel region (identity; all-reduce the gradient)."""
    return _CopyToTensorRegion.apply(x, group)


@torch.compiler.disable
def reduce_from_tensor_region(x: Tensor, group: Group) -> Tensor:
    """Megatron's ``g``: leave a tensor-parallel region (all-reduce; gradient passes through)."""
    return _ReduceFromTensorRegion.apply(x, group)


@torch.compiler.disable
def scatter_to_tensor_region(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's chunk of the last dimension; the gradient is all-gathered."""
    return _ScatterToTensorRegion.apply(x, group)


@torch.compiler.disable
def gather_from_tensor_region(x: Tensor, group: Group) -> Tensor:
    """All-gather the last dimension; the gradient is split back to this rank's chunk."""
    return _GatherFromTensorRegion.apply(x, group)


@torch.compiler.disable
def scatter_to_sequence_region(x: Tensor, group: Group, dim: int = SEQ_DIM) -> Tensor:
    """Keep this rank's chunk of the sequence; the gradient is all-gathered."""
    return _ScatterToSequenceRegion.apply(x, group, dim)


@torch.compiler.disable
def gather_from_sequence_region(
    x: Tensor, group: Group, dim: int = SEQ_DIM, grad_is_partial: bool = True
) -> Tensor:
    """All-gather the sequence; the gradient is reduce-scattered (``grad_is_partial``, the case
    in front of a column-parallel layer, whose ranks each hold part of the input's gradient) or
    merely split (when every rank already holds the full gradient)."""
    return _GatherFromSequenceRegion.apply(x, group, dim, grad_is_partial)


@torch.compiler.disable
def reduce_scatter_to_sequence_region(x: Tensor, group: Group, dim: int = SEQ_DIM) -> Tensor:
    """Sum partial results and keep this rank's sequence chunk; the gradient is all-gathered."""
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)
