"""What each ZeRO stage keeps per rank, measured on the tensors themselves (not on the engine's
own bookkeeping), at dp=2 on the tiny GPT (3 blocks + the rest unit):

* optimizer state: the bytes of the AdamW moment tensors. Each rank holds 1/dp of zero=0's, up to
  the padding (at most dp-1 elements per unit), and the ranks' shares add up to zero=0's exactly.
* gradients after backward: the distinct storages behind every ``.grad`` the model and the
  optimizer see. Stage 2 (and 3) keep 1/dp of zero=0's plus padding; stage 1 keeps the full
  buffer plus its shard.
* ZeRO-3's full parameters: a ``TorchDispatchMode`` and saved-tensor hooks sample, at every op of
  a forward + backward + step (after a first step, so the prefetch order is known), the bytes of
  the distinct storages behind the model's parameters. The peak must be two blocks -- the one
  computing and the one being prefetched -- and never more; a control that never frees exceeds it.

The engine's ``memory_stats()`` must report the same params/grads/optim numbers.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.zero_workload import (
    ACCUMULATE,
    MAX_NORM,
    loss_of,
    micro_batch,
    optimizer_for,
    tiny_gpt,
)
from llmlab.parallel.data.zero import ZeroEngine
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


class ParameterStorageMeter(TorchDispatchMode):
    """Samples the bytes of the storages behind ``params`` before and after every op."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = params
        self.peak = 0
        self.samples = 0

    def sample(self) -> None:
        storages = {}
        for p in self.params:
            s = p.untyped_storage()
            if s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        self.samples += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def _grad_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    grads = [p.grad for p in model.parameters()]
    grads += [p.grad for g in opt.param_groups for p in g["params"]]
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads if
                g is not None}  # fmt: skip
    return sum(storages.values())


def _optim_bytes(opt: torch.optim.Optimizer, scalars: bool = False) -> int:
    """Bytes of the optimizer's state tensors (AdamW's 4-byte ``step`` counters only if asked:
    a parameter cut between two ranks has one on each)."""
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if scalars or v.dim() > 0)


def _step(model, engine, opt, step: int, rank: int, world: int, meter=None) -> int:
    """One optimizer step; returns the gradient bytes present after backward."""
    opt.zero_grad(set_to_none=True)
    for micro in range(ACCUMULATE):
        last = micro == ACCUMULATE - 1
        with nullcontext() if last else engine.no_sync():
            loss = loss_of(model, *micro_batch(step, micro, rank, world)) / ACCUMULATE
            loss.backward()
    grads = _grad_bytes(model, opt)
    engine.clip_grad_norm_(MAX_NORM)
    opt.step()
    return grads


def measure(rank: int, world: int) -> dict:
    out = {}
    for stage, never_free in ((0, False), (1, False), (2, False), (3, False), (3, True)):
        model = tiny_gpt(seed=rank)
        engine = ZeroEngine(model, stage=stage)
        if never_free:
            engine.stage3.free = lambda unit: None  # the control: gathered units never released
        opt, _ = optimizer_for(model)
        engine.rewire(opt)
        _step(model, engine, opt, 0, rank, world)  # warm-up: optimizer state, prefetch order
        meter = ParameterStorageMeter(list(model.parameters()))

        def pack(t: torch.Tensor, meter=meter) -> torch.Tensor:
            meter.sample()
            return t

        with meter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grads = _step(model, engine, opt, 1, rank, world)
        out[(stage, never_free)] = {
            "grads": grads,
            "optim": _optim_bytes(opt),
            "optim_all": _optim_bytes(opt, scalars=True),
            "param_peak": meter.peak,
            "samples": meter.samples,
            "stats": engine.memory_stats(),
            "unit_bytes": [u.full.nbytes for u in engine.units],
            "units": len(engine.units),
            "shard_bytes": sum(u.shard.nbytes for u in engine.units),
        }
    return out


def test_per_rank_bytes_shrink_by_dp_and_zero3_holds_two_blocks() -> None:
    world = 2
    results = run_distributed(measure, world)
    ddp = [r[(0, False)] for r in results]
    units = ddp[0]["units"]
    pad = (world - 1) * units  # elements of padding at most, over all units
    optim0, grads0 = ddp[0]["optim"], ddp[0]["grads"]
    for stage in (1, 2, 3):
        shares = [r[(stage, False)]["optim"] for r in results]
        assert sum(shares) == optim0, (stage, shares, optim0)  # every moment exactly once
        for share in shares:
            assert abs(share - optim0 / world) <= 8 * pad, (stage, share, optim0 / world)
    for r in results:
        assert r[(1, False)]["grads"] == grads0 + grads0 // world  # full buffer + its shard
        for stage in (2, 3):
            assert abs(r[(stage, False)]["grads"] - grads0 / world) <= 4 * pad, stage
        for key, m in r.items():  # the engine's own accounting agrees with the tensors
            assert m["stats"]["memory/grads_bytes"] == m["grads"], key
            assert m["stats"]["memory/optim_bytes"] == m["optim_all"], key
    for r in results:
        z3, ctrl = r[(3, False)], r[(3, True)]
        block = max(z3["unit_bytes"])
        assert z3["samples"] > 1000  # every op of forward, backward and the step was seen
        assert z3["param_peak"] == 2 * block, (z3["param_peak"], z3["unit_bytes"])
        assert z3["stats"]["memory/params_bytes"] == z3["shard_bytes"]
        assert z3["shard_bytes"] * world == sum(z3["unit_bytes"])
        assert ctrl["param_peak"] == sum(ctrl["unit_bytes"]) > 2 * block
        # the zero=0 replica keeps every parameter: what ZeRO-3 gathers two blocks at a time
        assert r[(0, False)]["stats"]["memory/params_bytes"] == sum(z3["unit_bytes"])
