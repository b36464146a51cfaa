"""``llmlab.parallel.loss_mean``: the global batch's token mean from ranks holding unequal counts.

Two gloo ranks split a batch whose rows hold unequal numbers of counted targets (one rank's
share is all padding in one case). The value of :func:`global_token_mean` must be one process's
loss on every rank, and its gradient, averaged over the ranks as data parallelism does, one
process's gradient. The control: the mean of the ranks' own means (what was logged before) is
off by far more than the tolerance on the same batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmlab.parallel.loss_mean import (
    IGNORE_INDEX,
    LossReplicas,
    counted_tokens,
    global_token_mean,
    loss_replicas,
)
from tests.helpers.distributed import run_distributed

TOL = 1e-6
B, T, V = 4, 6, 11


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, V, generator=g)
    inputs = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 4:] = IGNORE_INDEX  # rank 0 (rows 0-1): 10 counted
    targets[2:, :5] = IGNORE_INDEX  # rank 1 (rows 2-3): 2 counted
    return weight, inputs, targets


def _local_mean(weight, inputs, targets) -> torch.Tensor:
    total = F.cross_entropy(
        (inputs @ weight).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )  # fmt: skip
    return total / counted_tokens(targets).clamp(min=1)


def _rank(rank: int, world: int, all_padding: bool) -> dict:
    weight, inputs, targets = _batch()
    if all_padding:
        targets[2:] = IGNORE_INDEX
    rows = slice(rank * B // world, (rank + 1) * B // world)
    w = weight.clone().requires_grad_()
    local = _local_mean(w, inputs[rows], targets[rows])
    loss = global_token_mean(local, counted_tokens(targets[rows]), LossReplicas(None, world))
    loss.backward()
    dist.all_reduce(w.grad)
    w.grad /= world  # what DDP does
    naive = local.detach().clone()
    dist.all_reduce(naive)
    return {"loss": loss.item(), "grad": w.grad, "mean_of_means": naive.item() / world}


@pytest.mark.distributed
@pytest.mark.parametrize("all_padding", [False, True])
def test_global_token_mean_is_one_process_loss_and_gradient(all_padding: bool) -> None:
    weight, inputs, targets = _batch()
    if all_padding:
        targets[2:] = IGNORE_INDEX
    w = weight.clone().requires_grad_()
    want = _local_mean(w, inputs, targets)
    want.backward()
    results = run_distributed(_rank, 2, all_padding)
    for r in results:
        assert abs(r["loss"] - want.item()) <= TOL * abs(want.item()), (r["loss"], want)
        assert torch.allclose(r["grad"], w.grad, rtol=1e-5, atol=1e-7)
    off = abs(results[0]["mean_of_means"] - want.item())
    assert off > 100 * TOL * abs(want.item()), "the control: counts must differ enough to matter"


def test_one_rank_is_its_own_mean_and_an_unknown_strategy_is_alone() -> None:
    weight, inputs, targets = _batch()
    local = _local_mean(weight, inputs, targets)
    assert global_token_mean(local, counted_tokens(targets), LossReplicas()) is local
    assert loss_replicas(object()) == LossReplicas()
    empty = torch.full((2, 3), IGNORE_INDEX)
    assert _local_mean(weight, torch.randn(2, 3, V), empty).item() == 0.0  # 0, not NaN
