"""Mappings equal their definitions; each sharded layer equals its torch counterpart (1e-6).

One distributed function per world size runs every check (process start-up dominates the cost).
References: the definitions written out with plain tensor ops, ``nn.Linear``, ``nn.Embedding``,
``F.cross_entropy``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_distributed

TOL = dict(atol=1e-6, rtol=1e-6)


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _check_mappings(rank: int, n: int) -> None:
    from llmlab.parallel.tensor import count_comm
    from llmlab.parallel.tensor import mappings as M

    B, T, D = 2, 4 * n, 3 * n
    per_rank = [_rand(100 + r, B, T, D) for r in range(n)]  # a different tensor on each rank
    grads = [_rand(200 + r, B, T, D) for r in range(n)]
    total, grad_total = sum(per_rank), sum(grads)
    shared = _rand(7, B, T, D)  # the same tensor on every rank

    # f: copy forward, all-reduce backward.
    x = shared.clone().requires_grad_()
    with count_comm() as ledger:
        y = M.copy_to_tensor_region(x, None)
        _close(y, shared, "copy.forward")
        y.backward(grads[rank])
    _close(x.grad, grad_total, "copy.backward")
    assert ledger.counts()["all_reduce"] == 1 and ledger.total_bytes == shared.numel() * 4

    # g: all-reduce forward, identity backward.
    x = per_rank[rank].clone().requires_grad_()
    y = M.reduce_from_tensor_region(x, None)
    _close(y, total, "reduce.forward")
    y.backward(grads[rank])
    _close(x.grad, grads[rank], "reduce.backward")

    # scatter / gather along the last dimension.
    x = shared.clone().requires_grad_()
    y = M.scatter_to_tensor_region(x, None)
    _close(y, shared.chunk(n, -1)[rank], "scatter_last.forward")
    g_local = [g.chunk(n, -1)[r] for r, g in enumerate(grads)]
    y.backward(g_local[rank])
    _close(x.grad, torch.cat(g_local, -1), "scatter_last.backward")

    local = [p.chunk(n, -1)[r] for r, p in enumerate(per_rank)]
    x = local[rank].clone().requires_grad_()
    y = M.gather_from_tensor_region(x, None)
    _close(y, torch.cat(local, -1), "gather_last.forward")
    y.backward(grads[rank])
    _close(x.grad, grads[rank].chunk(n, -1)[rank], "gather_last.backward")

    # The sequence-parallel pair (sequence = dim 1).
    x = shared.clone().requires_grad_()
    y = M.scatter_to_sequence_region(x, None)
    _close(y, shared.chunk(n, 1)[rank], "scatter_seq.forward")
    g_seq = [g.chunk(n, 1)[r] for r, g in enumerate(grads)]
    y.backward(g_seq[rank])
    _close(x.grad, torch.cat(g_seq, 1), "scatter_seq.backward")

    seq_local = [p.chunk(n, 1)[r] for r, p in enumerate(per_rank)]
    for partial in (True, False):
        x = seq_local[rank].clone().requires_grad_()
        with count_comm() as ledger:
            y = M.gather_from_sequence_region(x, None, grad_is_partial=partial)
            _close(y, torch.cat(seq_local, 1), "gather_seq.forward")
            y.backward(grads[rank])
        expected = (grad_total if partial else grads[rank]).chunk(n, 1)[rank]
        _close(x.grad, expected, f"gather_seq.backward(partial={partial})")
        kinds = ledger.counts()
        assert kinds["all_gather"] == 1 and kinds["reduce_scatter"] == int(partial), kinds

    x = per_rank[rank].clone().requires_grad_()
    with count_comm() as ledger:
        y = M.reduce_scatter_to_sequence_region(x, None)
        _close(y, total.chunk(n, 1)[rank], "reduce_scatter_seq.forward")
        y.backward(g_seq[rank])
    _close(x.grad, torch.cat(g_seq, 1), "reduce_scatter_seq.backward")
    assert ledger.totals() == {
        "all_reduce": 0,
        "all_gather": x.numel() * 4,
        "reduce_scatter": x.numel() * 4,
    }


def _check_linear_layers(rank: int, n: int) -> None:
    from llmlab.parallel.tensor import (
        ColumnParallelLinear,
        RowParallelLinear,
        gather_from_sequence_region,
        scatter_to_sequence_region,
        scatter_to_tensor_region,
    )

    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 4 * n), nn.Linear(4 * n, 8)
    x_full = _rand(3, 2, 2 * n, 8)
    w_out = _rand(4, 2, 2 * n, 8)

    # Reference: the unsharded MLP on the full input.
    x_ref = x_full.clone().requires_grad_()
    y_ref = proj(F.gelu(fc(x_ref)))
    (y_ref * w_out).sum().backward()
    ref = {k: p.grad.clone() for k, p in (("fc.w", fc.weight), ("fc.b", fc.bias))}
    ref.update({"proj.w": proj.weight.grad.clone(), "proj.b": proj.bias.grad.clone()})

    # ColumnParallelLinear with a gathered output == nn.Linear (output, input grad, shards' grads).
    col = ColumnParallelLinear(fc, None, gather_output=True)
    assert col.weight.shape == (4, 8), col.weight.shape  # 1/n of the rows (measured)
    x = x_full.clone().requires_grad_()
    y = col(x)
    _close(y, fc(x_full), "column(gather).forward")
    g = _rand(5, *y.shape)
    y.backward(g)
    x_lin = x_full.clone().requires_grad_()
    w_lin = fc.weight.detach().clone().requires_grad_()
    b_lin = fc.bias.detach().clone().requires_grad_()
    F.linear(x_lin, w_lin, b_lin).backward(g)
    _close(x.grad, x_lin.grad, "column(gather).grad_input")
    _close(col.weight.grad, w_lin.grad.chunk(n, 0)[rank], "column.grad_weight")
    _close(col.bias.grad, b_lin.grad.chunk(n, 0)[rank], "column.grad_bias")

    # RowParallelLinear on a split input == nn.Linear.
    row = RowParallelLinear(proj, None)
    assert row.weight.shape == (8, 4), row.weight.shape
    h_full = _rand(6, 2, 2 * n, 4 * n)
    _close(row(scatter_to_tensor_region(h_full, None)), proj(h_full), "row.forward")

    # Column -> GELU -> Row (an MLP), with and without sequence parallelism.
    for sp in (False, True):
        col = ColumnParallelLinear(fc, None, sequence_parallel=sp)
        row = RowParallelLinear(proj, None, sequence_parallel=sp)
        x = x_full.clone().requires_grad_()
        out = row(F.gelu(col(scatter_to_sequence_region(x, None) if sp else x)))
        if sp:  # every rank holds the full output gradient: gather, and split on the way back
            out = gather_from_sequence_region(out, None, grad_is_partial=False)
        _close(out, y_ref, f"mlp(sp={sp}).forward")
        (out * w_out).sum().backward()
        if sp:  # the replicated bias saw one sequence shard: its gradient is partial
            torch.distributed.all_reduce(row.bias.grad)
        _close(x.grad, x_ref.grad, f"mlp(sp={sp}).grad_input")
        _close(col.weight.grad, ref["fc.w"].chunk(n, 0)[rank], f"mlp(sp={sp}).fc.grad_weight")
        _close(col.bias.grad, ref["fc.b"].chunk(n, 0)[rank], f"mlp(sp={sp}).fc.grad_bias")
        _close(row.weight.grad, ref["proj.w"].chunk(n, 1)[rank], f"mlp(sp={sp}).proj.grad_w")
        _close(row.bias.grad, ref["proj.b"], f"mlp(sp={sp}).proj.grad_bias")


def _check_embedding_and_loss(rank: int, n: int) -> None:
    from llmlab.parallel.tensor import (
        VocabParallelEmbedding,
        gather_from_sequence_region,
        vocab_parallel_cross_entropy,
    )

    V, D = 8 * n, 6
    torch.manual_seed(1)
    emb = nn.Embedding(V, D)
    ids = torch.randint(0, V, (3, 2 * n), generator=torch.Generator().manual_seed(2))
    g = _rand(8, 3, 2 * n, D)
    emb(ids).backward(g)
    for sp in (False, True):
        vemb = VocabParallelEmbedding(emb, None, sequence_parallel=sp)
        assert vemb.weight.shape == (V // n, D)
        out = vemb(ids)
        if sp:
            out = gather_from_sequence_region(out, None, grad_is_partial=False)
        _close(out, emb(ids), f"embedding(sp={sp}).forward")
        out.backward(g)
        _close(vemb.weight.grad, emb.weight.grad.chunk(n, 0)[rank], f"embedding(sp={sp}).grad")

    # Cross-entropy over vocab shards == F.cross_entropy, with ignored targets and large logits.
    logits = _rand(9, 10, V) * 30.0
    targets = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(3))
    targets[[2, 7]] = -100
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full, targets, reduction=reduction)
        shard = logits.chunk(n, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets, None, reduction=reduction)
        _close(loss, expected, f"cross_entropy({reduction}).loss")
        w = _rand(10, *expected.shape)
        (expected * w).sum().backward()
        (loss * w).sum().backward()
        _close(shard.grad, full.grad.chunk(n, -1)[rank], f"cross_entropy({reduction}).grad")


def _check_rng(rank: int, n: int) -> list[list[float]]:
    from llmlab.parallel.tensor import TensorParallelRNG

    torch.manual_seed(11)
    rng = TensorParallelRNG(seed=11, tp_rank=rank)
    outside_1 = torch.rand(4)
    with rng.fork():
        inside_1 = torch.rand(4)
    outside_2 = torch.rand(4)
    with rng.fork():
        inside_2 = torch.rand(4)
    torch.manual_seed(11)
    plain = torch.rand(8)
    # The forked stream neither consumes nor perturbs the default stream, and it advances.
    _close(torch.cat([outside_1, outside_2]), plain, "default stream untouched by fork")
    assert not torch.equal(inside_1, inside_2)
    return [outside_1.tolist(), inside_1.tolist()]  # plain lists cross processes safely


def all_checks(rank: int, world_size: int) -> list[list[float]]:
    _check_mappings(rank, world_size)
    _check_linear_layers(rank, world_size)
    _check_embedding_and_loss(rank, world_size)
    return _check_rng(rank, world_size)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_and_layers_match_definitions(world_size: int) -> None:
    results = run_distributed(all_checks, world_size)
    # Dropout outside tensor-parallel regions: the same stream on every rank; inside: per rank.
    outside = [r[0] for r in results]
    inside = [r[1] for r in results]
    assert all(o == outside[0] for o in outside)
    assert len({tuple(i) for i in inside}) == world_size
