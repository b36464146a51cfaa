"""Mixed precision under ZeRO: fp32 master *shards* behind a bf16 (or fp16) model.

Oracle: the same model, data and ranks at zero=0 with the precision package's own
``MasterWeights`` (full fp32 masters, the optimizer rewired to them) -- the path the precision
plugins take today. At ZeRO-1/2/3 the engine keeps the fp32 masters as shards and
``ZeroMasterWeights`` keeps only the loss scale. Gradients are reduced in the compute dtype in
both (the parameters' dtype, as DeepSpeed and FSDP do by default), and at dp=2 a two-term sum is
the same in any order, so losses and fp32 masters must agree within 1e-6 (measured: equal).
No clipping here (the fp32 test covers it): the two paths sum the norm's squares in different
orders, a 1e-7 relative change of the clip factor, and one bf16 rounding flipped by it moves the
loss by 1e-5 -- a difference of rounding, not of sharding.
fp16 runs with a dynamic loss scale started at 2**20 with growth every 3 steps, so that steps
overflow and are skipped: both paths must skip the same steps and end at the same scale.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from benchmarks.zero_workload import (
    ACCUMULATE,
    curve_diff,
    loss_of,
    max_diff,
    micro_batch,
    optimizer_for,
    tiny_gpt,
)
from llmlab.parallel.checkpoint.zero_state import zero_full_params
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.data.zero_precision import ZeroMasterWeights
from llmlab.parallel.precision.master import MasterWeights
from llmlab.parallel.precision.scaler import DynamicLossScaler
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed
STEPS = 8


def _scaler(dtype: torch.dtype) -> DynamicLossScaler | None:
    if dtype == torch.bfloat16:
        return None
    return DynamicLossScaler(init_scale=2.0**20, growth_interval=3, hysteresis=1)


def train(rank: int, world: int, stage: int, dtype: torch.dtype) -> dict:
    model = tiny_gpt(n_layer=2)
    initial = {id(p): p.detach().clone() for p in model.parameters()}
    model = model.to(dtype)
    engine = ZeroEngine(model, stage=stage, initial=initial)
    opt, sched = optimizer_for(model)
    if stage == 0:
        masters = MasterWeights(model.parameters(), _scaler(dtype), initial)
        names = dict(zip(map(id, masters.masters), [n for n, _ in model.named_parameters()]))
    else:
        masters = ZeroMasterWeights(engine, _scaler(dtype))
    masters.rewire(opt)
    losses, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            with nullcontext() if micro == ACCUMULATE - 1 else engine.no_sync():
                loss = loss_of(model, *micro_batch(step, micro, rank, world)) / ACCUMULATE
                masters.scale_loss(loss).backward()
            total += loss.detach().float()
        found_inf = masters.unscale()
        masters.step(opt, found_inf)
        sched.step()
        skipped.append(found_inf)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if stage == 0:
        params = {names[id(m)]: m.detach().clone() for m in masters.masters}
    else:
        params = zero_full_params(engine)
    return {"losses": losses, "params": params, "skipped": skipped, "scale": masters.loss_scale}


def both(rank: int, world: int, dtype: torch.dtype, stages: tuple[int, ...]) -> dict:
    return {stage: train(rank, world, stage, dtype) for stage in (0, *stages)}


@pytest.mark.parametrize(
    ("dtype", "stages"),
    [(torch.bfloat16, (1, 2, 3)), pytest.param(torch.float16, (3,), marks=pytest.mark.slow)],
)
def test_master_shards_match_full_master_weights(dtype, stages) -> None:
    results = run_distributed(both, 2, dtype, stages)
    for rank, by_stage in enumerate(results):
        ref = by_stage[0]
        assert all(p.dtype == torch.float32 for p in ref["params"].values())
        for stage in stages:
            r = by_stage[stage]
            case = f"{dtype} rank {rank} zero={stage}"
            assert r["skipped"] == ref["skipped"], case
            assert r["scale"] == ref["scale"], case
            assert curve_diff(r["losses"], ref["losses"]) <= 1e-6, case
            assert max_diff(r["params"], ref["params"]) <= 1e-6, case
    if dtype == torch.float16:
        assert any(results[0][0]["skipped"]), "the fp16 run never overflowed: no skip was tested"
