"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each rank holds logits ``z[..., start:end]``. With ``m = max_v z_v`` (an all-reduce MAX),
``S = Σ_v exp(z_v - m)`` (an all-reduce SUM of local sums) and the target's shifted logit
``z_t - m`` (an all-reduce SUM: only the rank owning ``t`` contributes), the loss is

    loss = log S - (z_t - m)

and its gradient w.r.t. the local logits is ``softmax(z)[start:end] - onehot(t)[start:end]``,
computed locally. Three all-reduces of B×T numbers replace an all-gather of B×T×V.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.primitives import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, group: Group, ignore_index: int
    ) -> Tensor:
        vocab_local = logits.shape[-1]
        start = C.group_rank(group) * vocab_local
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64
        local_max = logits.max(dim=-1).values
        global_max = C.all_reduce(local_max, group, "cross_entropy.max", op="max")
        shifted = logits - global_max.unsqueeze(-1)

        outside = (targets < start) | (targets >= start + vocab_local)
        local_t = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        target_logit = C.all_reduce(target_logit, group, "cross_entropy.target_logit")

        exp = shifted.exp()
        sum_exp = C.all_reduce(exp.sum(dim=-1), group, "cross_entropy.sum_exp")
        loss = sum_exp.log() - target_logit
        ignored = targets == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        owned = ~outside
        hit = torch.zeros_like(grad).scatter_(
            -1, local_t.unsqueeze(-1), owned.unsqueeze(-1).to(grad.dtype)
        )
        grad.sub_(hit)
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    group: Group,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy`` of the full logits, from this rank's vocabulary shard ``logits``.

    ``logits``: (..., V/tp), this rank's contiguous slice of the vocabulary; ``targets``: (...)
    global token ids. ``reduction``: "mean" (over non-ignored targets, as torch), "sum", "none".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
            "expected logits of shape targets.shape + (V/tp,)"
        )
    losses = _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


class VocabParallelCrossEntropy:
    """``loss_fn(logits, targets)`` over vocab-sharded logits (a drop-in for a task's loss_fn).

    Flattens (B, T, V/tp) to tokens like a causal-LM task's ``F.cross_entropy`` call does; the
    mean over the counted targets, 0 where none counts (as the task's loss: a rank whose tokens
    are all ignored still joins the global token mean, :mod:`llmlab.parallel.loss_mean`).
    """

    def __init__(self, group: Group, ignore_index: int = -100) -> None:
        self.group = group
        self.ignore_index = ignore_index

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        total = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            self.group,
            self.ignore_index,
            reduction="sum",
        )
        return total / (targets != self.ignore_index).sum().clamp(min=1)
