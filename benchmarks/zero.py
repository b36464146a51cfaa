"""llmlab's ZeRO side by side with DeepSpeed's: the same model, batch and steps.

Both train the tiny GPT of ``benchmarks/zero_workload.py`` on 2 gloo ranks for 20 steps
with the task's AdamW (two param groups, warmup + cosine), clipping at 0.3 and 2 accumulated
micro-batches, fp32: DeepSpeed ZeRO 1/2/3 through Lightning (``PortableDeepSpeedStrategy``, the
task's torch AdamW as its client optimizer), llmlab's ``ZeroEngine`` from a plain loop (zero=0..3).

Per rank and per stage it reports, measured the same way on both sides:

* the loss curve: the largest difference from DeepSpeed at the same stage over the 20 steps;
* ``params``: bytes of the distinct storages behind the model's parameters after a step (plus
  DeepSpeed-3's ``ds_tensor`` shards / llmlab-3's compute shards);
* ``optim``: bytes of the torch AdamW's moment tensors (its ``step`` counters excluded);
* ``state``: bytes of every distinct tensor storage reachable from the ZeRO object (DeepSpeed's
  ZeRO optimizer, llmlab's engine), the optimizer and the model when the reduced gradients are
  ready for the step: parameters, gradients, fp32 partitions or masters, buckets, optimizer state;
* ``ms/step``: best of the steps after the first, wall time, for context only: DeepSpeed runs
  inside Lightning's Trainer (about 11 ms/step of loop overhead on a model this small, see
  FIELD-NOTES) and llmlab in a plain loop, so no speed ratio is reported.

    python -m benchmarks.zero [--steps 20] [--world 2] [--markdown benchmarks/results/zero.md]

``--smoke``: 3 steps, ZeRO-1 only (llmlab's stages 0 and 1, DeepSpeed's stage 1).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.common import Row, parse_args, report, results_dir
from llmlab.parallel.launch import run_distributed

REPO = Path(__file__).resolve().parent.parent
STAGES = (1, 2, 3)


# --------------------------------------------------------------------------- measuring
def reachable_storages(roots: Iterable[Any], max_depth: int = 8) -> dict[int, int]:
    """``data_ptr -> nbytes`` of every distinct tensor storage reachable from ``roots``.

    Modules contribute their parameters, gradients and buffers (not their submodule graph),
    optimizers their state and their params' gradients; other objects are walked through their
    ``__dict__``, lists, tuples, sets and dicts. Lightning objects (trainer, loops) are not
    entered, so the data loader and the logs are never counted.
    """
    import lightning as L

    found: dict[int, int] = {}
    seen: set[int] = set()

    def tensor(t: Tensor) -> None:
        if t.is_meta or type(t).__name__ == "ShardedView":
            return
        s = t.untyped_storage()
        if s.nbytes():
            found[s.data_ptr()] = s.nbytes()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            tensor(obj)
            if obj.grad is not None:
                tensor(obj.grad)
            ds = getattr(obj, "ds_tensor", None)  # DeepSpeed-3's partition of a parameter
            if isinstance(ds, Tensor):
                tensor(ds)
        elif isinstance(obj, L.Trainer | L.LightningModule):
            for p in obj.parameters() if isinstance(obj, nn.Module) else ():
                walk(p, depth + 1)
        elif isinstance(obj, nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                walk(t, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                walk(state, depth + 1)
            for group in obj.param_groups:
                walk(group["params"], depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, list | tuple | set):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            module = type(obj).__module__
            if module.startswith(("torch.distributed", "lightning", "builtins")):
                return
            walk(vars(obj), depth + 1)

    for root in roots:
        walk(root, 0)
    return found


def param_bytes(model: nn.Module, extra: Iterable[Tensor] = ()) -> int:
    found: dict[int, int] = {}
    for t in [*model.parameters(), *extra]:
        for s in [t.untyped_storage()] + (
            [t.ds_tensor.untyped_storage()] if isinstance(getattr(t, "ds_tensor", None), Tensor)
            else []
        ):  # fmt: skip
            if s.nbytes():
                found[s.data_ptr()] = s.nbytes()
    return sum(found.values())


def moment_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)


def _global_mean(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# --------------------------------------------------------------------------- llmlab
def llmlab_stages(rank: int, world: int, stages: tuple[int, ...], steps: int) -> dict[int, dict]:
    """``llmlab_rank`` for each stage in turn, in one spawn of the ranks (each costs seconds)."""
    return {stage: llmlab_rank(rank, world, stage, steps) for stage in stages}


def llmlab_rank(rank: int, world: int, stage: int, steps: int) -> dict[str, Any]:
    from benchmarks.zero_workload import train_zero
    from llmlab.parallel.data.zero import ZeroEngine

    torch.set_num_threads(1)
    probe: dict[str, Any] = {}
    times: list[float] = []

    lrs: list[float] = []

    def after_backward(model, engine, opt) -> None:
        times.append(time.perf_counter())
        lrs.append(opt.param_groups[0]["lr"])
        if "state" not in probe and len(times) > 1:
            probe["state"] = sum(reachable_storages([engine, opt, model]).values())

    result = train_zero(partial(ZeroEngine, stage=stage), rank, world, steps=steps,
                        after_backward=after_backward)  # fmt: skip
    model, engine, opt, _ = result["state"]
    shards = [u.shard for u in engine.units] if stage >= 3 else []
    return {
        "losses": result["losses"],
        "lrs": lrs,
        "params": param_bytes(model, shards),
        "optim": moment_bytes(opt),
        "state": probe["state"],
        "step_s": min(b - a for a, b in itertools.pairwise(times[1:])),
        "engine": engine.memory_stats(),
    }


# --------------------------------------------------------------------------- DeepSpeed
def deepspeed_rank(rank: int, world: int, stage: int, steps: int) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks import zero_workload as common
    from llmlab.parallel.deepspeed import PortableDeepSpeedStrategy

    torch.set_num_threads(1)
    acc = common.ACCUMULATE
    batches = [common.micro_batch(s, m, rank, world) for s in range(steps) for m in range(acc)]
    loader = DataLoader(
        TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])),
        batch_size=batches[0][0].shape[0],
        shuffle=False,
    )

    class Task(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = common.tiny_gpt()
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = common.loss_of(self.model, *batch)
            self.losses.append(loss.item())
            # Lightning divides the loss by accumulate_grad_batches and DeepSpeed's
            # engine.backward divides it again: undone here, so both sides clip the same gradient
            return loss * common.ACCUMULATE

        def configure_optimizers(self) -> Any:
            opt, sched = common.optimizer_for(self.model)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    probe: dict[str, Any] = {}
    times: list[float] = []
    lrs: list[float] = []

    calls = [0]

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            # Lightning calls this on every micro-batch under DeepSpeed (its engine accumulates);
            # only the last of each step is an optimizer step with reduced gradients
            calls[0] += 1
            if calls[0] % common.ACCUMULATE:
                return
            times.append(time.perf_counter())
            lrs.append(optimizer.param_groups[0]["lr"])
            if "state" not in probe and len(times) > 1:
                zero = trainer.strategy.model.optimizer
                probe["state"] = sum(reachable_storages([zero, pl_module.model]).values())

    task = Task()
    bucket = max(sum(p.numel() for p in b.parameters()) for b in task.model.repeated_blocks())
    config = {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": stage,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
        },
    }
    strategy = PortableDeepSpeedStrategy(config=config, cluster_environment=LightningEnvironment())
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=acc, gradient_clip_val=common.MAX_NORM, precision="32-true",
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(task, loader)
    per_step = [
        sum(task.losses[i : i + common.ACCUMULATE]) / common.ACCUMULATE
        for i in range(0, len(task.losses), common.ACCUMULATE)
    ]
    zero = trainer.strategy.model.optimizer
    inner = getattr(zero, "optimizer", zero)
    return {
        "losses": _global_mean(per_step),
        "lrs": lrs,
        "params": param_bytes(task.model),
        "optim": moment_bytes(inner),
        "state": probe["state"],
        "step_s": min(b - a for a, b in itertools.pairwise(times[1:])),
    }


# --------------------------------------------------------------------------- table
def markdown(
    ours: dict[int, list[dict]],
    theirs: dict[int, list[dict]],
    steps: int,
    stages: tuple[int, ...] = STAGES,
) -> str:
    kb = 1024
    lines = [
        "| stage | run | max \\|Δloss\\| vs DeepSpeed | params KiB | optim KiB | state KiB "
        "| ms/step | loss at steps 1, 10, 20 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in (0, *stages):
        runs = [("llmlab", ours[stage])] + ([("DeepSpeed", theirs[stage])] if stage in theirs
                                            else [])  # fmt: skip
        for name, by_rank in runs:
            r = by_rank[0]
            ref = theirs.get(stage, theirs[1])[0]["losses"]
            diff = max(abs(a - b) for a, b in zip(r["losses"], ref))
            picks = ", ".join(f"{r['losses'][i]:.6f}" for i in (0, steps // 2 - 1, steps - 1))
            lines.append(
                f"| {stage} | {name} | {'-' if name == 'DeepSpeed' else f'{diff:.1e}'} "
                f"| {r['params'] / kb:.1f} | {r['optim'] / kb:.1f} | {r['state'] / kb:.1f} "
                f"| {1000 * r['step_s']:.1f} | {picks} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--markdown", help="the table's file (default: results/zero.md)")
    args = parse_args(parser, argv)
    stages = (1,) if args.smoke else STAGES
    if args.smoke:
        args.steps = 3  # the step time needs two steps after the first
    markdown_path = Path(args.markdown) if args.markdown else results_dir() / "zero.md"
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        report("zero", [], skipped="deepspeed is not installed")
        return
    by_rank = run_distributed(llmlab_stages, args.world, (0, *stages), args.steps, timeout=900)
    ours = {s: [r[s] for r in by_rank] for s in (0, *stages)}
    theirs = {s: run_distributed(deepspeed_rank, args.world, s, args.steps, timeout=900)
              for s in stages}  # fmt: skip
    rows = []
    for s in stages:
        a, b = ours[s][0], theirs[s][0]
        diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        rows.append(Row(f"zero={s} model state at the step (bytes/rank)", a["state"],
                        b["state"], "DeepSpeed", "B", higher_is_better=False,
                        extra={"max_loss_diff": diff, "params": (a["params"], b["params"]),
                               "optim": (a["optim"], b["optim"])}))  # fmt: skip
    table = markdown(ours, theirs, args.steps, stages)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(
        f"`python -m benchmarks.zero --steps {args.steps} --world {args.world}` "
        f"({time.strftime('%Y-%m-%d')}, {sys.platform}, dp={args.world}; rank 0)\n\n{table}\n"
    )
    print(table)
    report("zero", rows, notes="per rank, dp=2; loss differences in the extra field")


if __name__ == "__main__":
    main()
