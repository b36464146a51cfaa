"""``ParameterServerStrategy``: synchronous mode against Lightning DDP, asynchronous mode runs.

Oracle: ``DDPStrategy`` on 2 ranks with the same shards; the parameter server runs 1 server and
2 workers on 3 ranks. Parameters after 20 steps and the workers' losses must match to 1e-6.
Async mode is non-deterministic: the test checks that it trains (loss goes down), that the
server never served a worker more than ``max_staleness`` steps ahead of the slowest, and that
the measured staleness is reported.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from llmlab.parallel.data import ParameterServerStrategy
from llmlab.parallel.data.parameter_server import assign_shards
from tests.helpers.distributed import run_distributed
from tests.parallel.data.common import TinyTask, flat_params, make_trainer, shard_loader

pytestmark = pytest.mark.distributed
STEPS = 20
WORKERS = 2


def ddp_fit(rank: int, world: int) -> dict:
    task = TinyTask()
    make_trainer(DDPStrategy(), world, STEPS).fit(task, shard_loader(world, rank, STEPS))
    # plain lists: tensors would travel through shared memory that dies with the rank
    return {"losses": task.losses, "params": flat_params(task).tolist()}


def ps_fit(rank: int, world: int, num_servers: int, modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        task = TinyTask()
        strategy = ParameterServerStrategy(num_servers=num_servers, mode=mode, max_staleness=1)
        trainer = make_trainer(strategy, world, STEPS)
        workers = world - num_servers  # servers read worker 0's shard only to pace their loop
        trainer.fit(task, shard_loader(workers, rank if rank < workers else 0, STEPS))
        out[mode] = {
            "server": strategy.is_server,
            "sampler": strategy.distributed_sampler_kwargs,
            "losses": task.losses,
            "params": flat_params(task).tolist(),
            "staleness": strategy.staleness,
            "clock_gaps": strategy.clock_gaps,
        }
    return out


def _check_sync(ps: list[dict], ddp: list[dict], workers: int) -> None:
    for rank, r in enumerate(ps):
        sync = r["sync"]
        assert sync["server"] == (rank >= workers)
        assert sync["sampler"] == {"num_replicas": workers, "rank": rank if rank < workers else 0}
        # every rank, servers included, ends with DDP's parameters (owners broadcast at the end)
        diff = (torch.tensor(sync["params"]) - torch.tensor(ddp[0]["params"])).abs().max().item()
        assert diff <= 1e-6, (rank, diff)
        if rank < workers:
            diffs = [abs(a - b) for a, b in zip(sync["losses"], ddp[rank]["losses"])]
            assert len(sync["losses"]) == STEPS and max(diffs) <= 1e-6, (rank, max(diffs))
            assert sync["staleness"] == [0] * STEPS  # sync: never stale
        else:
            assert sync["losses"] == []  # servers never run the model


def test_sync_matches_ddp_and_async_trains_with_bounded_staleness() -> None:
    ddp = run_distributed(ddp_fit, WORKERS)
    ps = run_distributed(ps_fit, WORKERS + 1, 1, ["sync", "async"])
    _check_sync(ps, ddp, WORKERS)

    server = ps[WORKERS]["async"]
    assert len(server["clock_gaps"]) == WORKERS * STEPS
    assert max(server["clock_gaps"]) <= 1  # max_staleness=1, enforced by the server
    for rank in range(WORKERS):
        a = ps[rank]["async"]
        assert len(a["staleness"]) == STEPS and min(a["staleness"]) >= 0
        first, last = sum(a["losses"][:5]) / 5, sum(a["losses"][-5:]) / 5
        assert last < first, (rank, first, last)
    # all ranks agree on the final parameters after the owners' broadcast
    finals = [r["async"]["params"] for r in ps]
    assert all(f == finals[0] for f in finals)


def ps_resume_fit(rank: int, world: int, ckpt_dir: str) -> dict:
    """Sync PS: 20 steps in one go, and 10 + resume to 20 (a 10-batch loader: 2 epochs)."""
    workers, half = world - 1, STEPS // 2

    def fit(max_steps: int, directory: str, resume: bool = False) -> list[float]:
        task = TinyTask()
        strategy = ParameterServerStrategy(num_servers=1, mode="sync")
        checkpoint = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=half)
        trainer = make_trainer(
            strategy, world, max_steps, enable_checkpointing=True, callbacks=[checkpoint]
        )
        loader = shard_loader(workers, rank if rank < workers else 0, half)
        trainer.fit(task, loader, ckpt_path=f"{directory}/last.ckpt" if resume else None)
        return flat_params(task).tolist()

    straight = fit(STEPS, f"{ckpt_dir}/straight")
    fit(half, f"{ckpt_dir}/resumed")
    return {"straight": straight, "resumed": fit(STEPS, f"{ckpt_dir}/resumed", resume=True)}


def test_sync_resume_restores_the_servers_optimizer_state(tmp_path) -> None:
    """The checkpoint carries the servers' AdamW moments: resuming at step 10 ends where the
    uninterrupted run ends (without them the moments restart from zero and it does not)."""
    results = run_distributed(ps_resume_fit, WORKERS + 1, str(tmp_path))
    for rank, r in enumerate(results):
        diff = (torch.tensor(r["straight"]) - torch.tensor(r["resumed"])).abs().max().item()
        assert diff <= 1e-6, (rank, diff)


@pytest.mark.slow
def test_sync_with_two_servers_matches_ddp() -> None:
    ddp = run_distributed(ddp_fit, WORKERS)
    ps = run_distributed(ps_fit, WORKERS + 2, 2, ["sync"])
    _check_sync(ps, ddp, WORKERS)


CLIP_STEPS, CLIP = 6, 0.01  # far below TinyTask's gradient norms: every step clips


def clipped_fit(rank: int, world: int, num_servers: int) -> dict:
    """DDP (``num_servers=0``) or a sync PS, clipping by norm at every step. The norm: DDP's
    gradient before clipping (Lightning's hook), the PS workers' logged ``train/grad_norm``."""
    norms: list[float] = []

    class RecordNorm(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if num_servers and not trainer.strategy.is_server:  # workers log it
                norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    task = TinyTask()
    workers = world - num_servers
    strategy = (
        ParameterServerStrategy(num_servers=num_servers, mode="sync")
        if num_servers
        else DDPStrategy()
    )
    trainer = make_trainer(
        strategy, world, CLIP_STEPS, gradient_clip_val=CLIP, callbacks=[RecordNorm()]
    )
    trainer.fit(task, shard_loader(workers, rank if rank < workers else 0, CLIP_STEPS))
    return {"params": flat_params(task).tolist(), "losses": task.losses, "norms": norms}


def test_sync_with_two_servers_clips_by_the_whole_models_norm() -> None:
    """Two servers each own part of the parameters; clipping must use the whole model's norm
    (the servers' shard norms combined), as DDP does, not each shard's own (it once did), and
    the workers log that norm as ``train/grad_norm``. Every step clips."""
    ddp = run_distributed(clipped_fit, WORKERS, 0)
    ps = run_distributed(clipped_fit, WORKERS + 2, 2)
    want = ddp[0]["norms"]
    assert len(want) == CLIP_STEPS and min(want) > 10 * CLIP, want
    for rank, r in enumerate(ps):
        diff = (torch.tensor(r["params"]) - torch.tensor(ddp[0]["params"])).abs().max().item()
        assert diff <= 1e-6, (rank, diff)
    for rank in range(WORKERS):
        diffs = [abs(a - b) for a, b in zip(ps[rank]["losses"], ddp[rank]["losses"])]
        assert len(diffs) == CLIP_STEPS and max(diffs) <= 1e-6, (rank, diffs)
        torch.testing.assert_close(
            torch.tensor(ps[rank]["norms"]), torch.tensor(want), rtol=1e-6, atol=0
        )


def test_async_with_two_servers_refuses_clipping_by_norm() -> None:
    from types import SimpleNamespace

    strategy = ParameterServerStrategy(num_servers=2, mode="async")
    clipping = SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    with pytest.raises(ValueError, match="needs the whole model's gradient"):
        strategy.setup(clipping)


def test_shards_are_balanced_and_complete() -> None:
    shards = assign_shards([100, 10, 60, 50, 5], 2)
    assert sorted(i for s in shards for i in s) == [0, 1, 2, 3, 4]
    assert shards == [[0, 1, 4], [2, 3]]  # loads 115 and 110


def test_bad_arguments_fail_early() -> None:
    with pytest.raises(ValueError, match="unknown parameter-server mode 'hogwild'"):
        ParameterServerStrategy(mode="hogwild")
    with pytest.raises(ValueError, match="num_servers must be a positive integer, got 0"):
        ParameterServerStrategy(num_servers=0)
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0, got -1"):
        ParameterServerStrategy(max_staleness=-1)
