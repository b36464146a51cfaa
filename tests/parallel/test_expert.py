"""Expert parallelism (issue 38): the mesh's expert groups, the all-to-all dispatch against the
unsplit MoE layer (forward and every gradient, uneven loads, an expert and a whole rank that
receive no row), and the refusals. Training with ``strategy.expert=2`` against one process is in
``tests/integration/test_expert_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from llmlab.parallel import ParallelDims
from llmlab.parallel.mesh import LayoutError
from tests.helpers.distributed import run_distributed

DIM, E, K, WIDTH, TOKENS = 16, 4, 2, 8, 12


def test_expert_groups_split_the_data_times_context_ranks():
    """expert=2 of data 4: two expert groups of neighbouring replicas, each expert index held
    by two ranks (the copies whose expert gradients are summed); the world size is unchanged."""
    dims = ParallelDims(data=4, expert=2)
    assert dims.world_size == 4 and dims.expert_copies == 2
    assert dims.expert_ranks() == [[0, 1], [2, 3]]
    assert dims.expert_copy_ranks() == [[0, 2], [1, 3]]
    assert [dims.expert_coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # data × context × tensor: experts over the replicas of each tensor rank
    dims = ParallelDims(data=1, context=2, tensor=2, expert=2)
    assert dims.expert_ranks() == [[0, 2], [1, 3]] and dims.expert_copy_ranks() == [
        [0], [2], [1], [3]
    ]  # fmt: skip


def test_an_expert_degree_that_does_not_divide_data_times_context_is_refused():
    with pytest.raises(LayoutError, match=r"expert=3 does not divide data \(2\) × context \(1\)"):
        ParallelDims(data=2, expert=3)
    with pytest.raises(LayoutError, match="expert=0 must be a positive integer"):
        ParallelDims(data=2, expert=0)
    with pytest.raises(LayoutError, match="expert=4 does not divide"):
        ParallelDims(data=None, expert=4).resolve(2)


def _layer(seed: int = 0):
    from llmlab.models.moe import MoE, MoEConfig

    torch.manual_seed(seed)
    layer = MoE(MoEConfig(dim=DIM, num_experts=E, top_k=K, intermediate_size=WIDTH))
    with torch.no_grad():  # feature 0 pushes experts 0-2 up and expert 3 far down: uneven loads
        layer.router.weight.mul_(10.0)
        layer.router.weight[:, 0] = torch.tensor([1.0, 0.9, 0.8, -10.0])
    return layer


def _inputs(world: int, skew: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(world * TOKENS, DIM, dtype=dtype)
    x[:, 0] = 5.0
    if skew:  # every token prefers experts 0 and 1: the rank holding 2-3 receives no row
        x[:, 0] = 50.0
    return x, torch.randn(world * TOKENS, DIM, dtype=dtype)


def _rank_dispatch(
    rank: int, world: int, skew: bool, dtype: torch.dtype, recompute: bool = False
) -> dict:
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from llmlab.parallel.expert import ExpertParallel

    ref = _layer().to(dtype)
    layer = _layer().to(dtype)
    ep = ExpertParallel(dist.group.WORLD, world, rank)
    assert ep.apply(layer) == 1
    x, w = _inputs(world, skew, dtype)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    xr, xl = x.clone().requires_grad_(), x[mine].clone().requires_grad_()
    want = ref(xr)
    (want * w).sum().backward()
    got = checkpoint(layer, xl, use_reentrant=False) if recompute else layer(xl)
    (got * w[mine]).sum().backward()
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # each rank's router saw its own tokens
    per = E // world
    counts = [torch.empty(E, dtype=torch.long) for _ in range(world)]  # every rank's routing
    dist.all_gather(counts, layer.stats.tokens_per_expert)
    mine_experts = slice(rank * per, (rank + 1) * per)
    sent = int(counts[rank].sum() - counts[rank][mine_experts].sum())  # S
    received = sum(int(c[mine_experts].sum()) for r, c in enumerate(counts) if r != rank)  # R
    row = DIM * x.element_size()
    forwards = 2 if recompute else 1  # a recomputed layer sends its rows and counts again
    formula = (1 + forwards) * (sent + received) * row + forwards * 8 * E * (world - 1) // world
    experts = {  # no gradient where no row came (the strategy's reducer fills in zeros)
        n: torch.zeros_like(p) if p.grad is None else p.grad
        for n, p in layer.experts.named_parameters()
    }
    want_experts = {
        n: p.grad[rank * per : (rank + 1) * per] for n, p in ref.experts.named_parameters()
    }
    return {
        "out": (got - want[mine]).abs().max().item(),
        "x_grad": (xl.grad - xr.grad[mine]).abs().max().item(),
        "router": (router - ref.router.weight.grad).abs().max().item(),
        "experts": max((experts[n] - want_experts[n]).abs().max().item() for n in experts),
        "shapes": {n: tuple(p.shape) for n, p in layer.experts.named_parameters()},
        "counts": ref.stats.tokens_per_expert.tolist(),
        "sent": ep.stats.take(),
        "formula": formula,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("skew", [False, True], ids=["uneven", "one-rank-idle"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_dispatch_equals_the_unsplit_layer_forward_and_backward(skew: bool, dtype):
    """Two ranks each hold 2 of 4 experts; the output, the input's, the router's and every
    expert slice's gradient equal the unsplit layer's on the whole batch (fp64: the per-expert
    matmuls, 1e-12; fp32: ``grouped_mm``, 1e-6). Loads are uneven and expert 3 gets no row;
    with ``skew`` experts 2-3 get none, so rank 1 computes nothing and still answers every
    all-to-all. The bytes counted equal the formula of ``comm/ep_bytes``."""
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    results = run_distributed(_rank_dispatch, 2, skew, dtype)
    counts = results[0]["counts"]
    assert counts[3] == 0 and len(set(counts)) > 1, counts
    if skew:
        assert counts[2] == 0, counts
    for r in results:
        assert r["shapes"]["gate_proj"] == (E // 2, WIDTH, DIM)
        assert r["shapes"]["down_proj"] == (E // 2, DIM, WIDTH)
        for key in ("out", "x_grad", "router", "experts"):
            assert r[key] < tol, (key, r)
    assert all(r["sent"] == r["formula"] for r in results), results  # comm/ep_bytes
    assert sum(r["sent"] for r in results) > 0


@pytest.mark.distributed
def test_a_recomputed_layer_repeats_its_all_to_alls_exactly():
    """Under activation checkpointing the layer's forward runs again in backward on every rank
    of the expert group (the same rows, the same all-to-alls, in the same order): the
    gradients are still the unsplit layer's, and the bytes are the formula's forward part
    twice: ``3·(S + R)·C·b`` and the counts twice (the README's ``comm/ep_bytes``)."""
    for r in run_distributed(_rank_dispatch, 2, False, torch.float32, True):
        for key in ("out", "x_grad", "router", "experts"):
            assert r[key] < 1e-6, (key, r)
        assert r["sent"] == r["formula"] > 0, r


def test_a_model_without_experts_is_refused():
    from llmlab.parallel.expert import ExpertParallel

    with pytest.raises(ValueError, match="found no mixture-of-experts layer"):
        ExpertParallel(None, 2, 0).apply(torch.nn.Linear(2, 2))


def test_the_moe_layer_meets_the_contract_structurally():
    from llmlab.parallel.contracts import ExpertParallelizable

    layer = _layer()
    assert isinstance(layer, ExpertParallelizable)
    assert set(layer.expert_parameters()) == {
        "experts.gate_proj", "experts.up_proj", "experts.down_proj"
    }  # fmt: skip
