"""``BucketedDataParallelStrategy`` against Lightning's DDP (torch's DistributedDataParallel).

Oracle: ``DDPStrategy`` on the same data shards, model and seed. Losses and parameters after 20
optimizer steps must agree within 1e-6, with and without gradient accumulation, for torch's
async all-reduce and for our ring all-reduce. Overlap is measured: on every step the first
bucket's all-reduce is launched before autograd has finished computing gradients, and the
``StepAnatomy`` callback measures a non-zero share of communication hidden under backward.
"""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy

from llmlab.parallel.data import BucketedDataParallelStrategy, StepAnatomy
from tests.helpers.distributed import run_distributed
from tests.parallel.data.common import TinyTask, flat_params, make_trainer, shard_loader

pytestmark = pytest.mark.distributed
STEPS = 20


def _fit(strategy, world: int, rank: int, accumulate: int, anatomy=None) -> tuple:
    import lightning as L

    task = TinyTask()
    overlap: list[tuple[float, float, float]] = []
    buckets: list[int] = []

    class Probe(L.Callback):
        def on_after_backward(self, trainer, pl_module) -> None:
            s = trainer.strategy
            if isinstance(s, BucketedDataParallelStrategy) and s.bucketer.launch_times:
                buckets[:] = [len(s.bucketer.buckets)]
                overlap.append(
                    (s.backward_start, min(s.bucketer.launch_times), s.backward_compute_end)
                )

    callbacks = [Probe()] + ([anatomy] if anatomy is not None else [])
    trainer = make_trainer(
        strategy, world, STEPS, accumulate_grad_batches=accumulate, callbacks=callbacks
    )
    trainer.fit(task, train_dataloaders=shard_loader(world, rank, STEPS * accumulate))
    return task.losses, flat_params(task), overlap, buckets


def compare_with_ddp(rank: int, world: int, out_dir: str) -> dict:
    out: dict = {}
    for accumulate in (1, 2):
        ref_losses, ref_params, _, _ = _fit(DDPStrategy(), world, rank, accumulate)
        for collective in ("torch", "ring"):
            strategy = BucketedDataParallelStrategy(bucket_cap_mb=0.01, collective=collective)
            anatomy = StepAnatomy(out_dir=out_dir, name=f"a{accumulate}_{collective}")
            losses, params, overlap, buckets = _fit(strategy, world, rank, accumulate, anatomy)
            out[(accumulate, collective)] = {
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "n_losses": (len(losses), len(ref_losses)),
                "param_diff": (params - ref_params).abs().max().item(),
                "overlap": overlap,
                "buckets": buckets[0] if buckets else 0,
                "anatomy": anatomy.summary(),
            }
    return out


def test_bucketed_matches_ddp_and_overlaps_backward(tmp_path) -> None:
    results = run_distributed(compare_with_ddp, 2, str(tmp_path))
    for rank, by_case in enumerate(results):
        for (accumulate, collective), r in by_case.items():
            case = f"rank {rank} accumulate={accumulate} collective={collective}"
            assert r["n_losses"] == (STEPS * accumulate, STEPS * accumulate), case
            assert r["loss_diff"] <= 1e-6, (case, r["loss_diff"])
            assert r["param_diff"] <= 1e-6, (case, r["param_diff"])
            # Overlap, measured: one record per optimizer step (accumulation steps launch
            # nothing), and each step's first all-reduce starts before backward compute ends.
            assert len(r["overlap"]) == STEPS, (case, len(r["overlap"]))
            assert r["buckets"] >= 3, case
            for start, first_launch, compute_end in r["overlap"]:
                assert start < first_launch < compute_end, (case, start, first_launch, compute_end)
            # StepAnatomy saw the same thing: communication, part of it hidden under backward,
            # and phases that add up to no more than the step
            a = r["anatomy"]
            assert a["steps"] == STEPS - 2 and a["comm"] > 0 and 0 < a["comm_hidden"] <= a["comm"]
            parts = a["forward"] + a["backward"] + a["comm_exposed"] + a["optimizer"]
            assert parts <= a["total"] * (1 + 1e-9), (case, a)
    for name in ("a1_torch", "a2_ring"):  # rank zero wrote the chart and its data
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        assert (tmp_path / f"{name}.json").exists()


def test_bad_arguments_fail_early() -> None:
    with pytest.raises(ValueError, match="unknown collective 'nccl'"):
        BucketedDataParallelStrategy(collective="nccl")
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got 0"):
        BucketedDataParallelStrategy(bucket_cap_mb=0)
