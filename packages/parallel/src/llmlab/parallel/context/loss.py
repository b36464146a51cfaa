"""The loss and the gradients of a sequence split across a context-parallel group.

**Loss.** The objective is the mean token loss over the *whole* sequence,
``L = Σ_all ℓ_t / n_all``. Rank ``r`` holds some of the tokens and computes its share
``L_r = Σ_{t on r} ℓ_t / n_all`` (``n_all``, the group's count of counted tokens, is one
all-reduce of integers, not differentiated), so ``Σ_r L_r = L`` exactly, also when
``ignore_index`` masks tokens unevenly across ranks.

**Gradients.** Every rank keeps a replica ``θ_r`` of each parameter and runs backward of its
own ``L_r``. Ring attention carries the gradient through the keys and values back to the rank
that produced them, so rank ``r`` ends with ``∂L/∂θ_r``: the gradient of the *whole* loss
through its copy. The true gradient is ``∂L/∂θ = Σ_r ∂L/∂θ_r``: a SUM all-reduce over the
context group (:func:`reduce_context_gradients`). Skip it and each rank steps with a part of
the gradient.

Folding into the data-parallel reduction: data parallelism averages over its ``D`` ranks. If
each rank backpropagates ``N · L_r`` (``scale=N`` in :func:`sequence_loss_share`) and the mean
is taken over the flattened data × context group of ``D·N`` ranks, the result is
``(1/D) Σ_d Σ_r ∂L_d/∂θ``: the same, in one collective (torchtitan's ``dp_cp`` mesh).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def sequence_loss_share(
    logits: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    scale: float = 1.0,
) -> Tensor:
    """This rank's share ``scale · Σ_local ℓ / n_all`` of the cross-entropy averaged over the
    whole sequence: the shares of the group sum to ``scale ×`` the unsplit mean.

    ``logits`` (B, T/N, V) and ``targets`` (B, T/N) are this rank's tokens.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must agree on "
            "(batch, local sequence)"
        )
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    count = (targets != ignore_index).sum().to(torch.int64)
    dist.all_reduce(count, group=group)
    if int(count) == 0:
        raise ValueError(
            f"no target in the whole sequence differs from ignore_index={ignore_index}"
        )
    return total * (scale / int(count))


def reduce_context_gradients(
    parameters: nn.Module | Iterable[Tensor],
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
) -> int:
    """All-reduce the gradients of replicated parameters over the context group, in place;
    returns how many gradients were reduced.

    ``op="sum"`` goes with :func:`sequence_loss_share` at ``scale=1``; ``"mean"`` with
    ``scale=N`` (the folded form). Gradients are flattened per dtype into one buffer, so a
    model costs one collective per dtype. Parameters without a gradient are skipped: every
    context rank runs the same model on equal-length chunks, so the set is the same everywhere.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"unknown reduction {op!r}; valid: ['sum', 'mean']")
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    size = dist.get_world_size(group)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        if op == "mean":
            flat.div_(size)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
