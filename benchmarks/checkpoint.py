"""Sharded checkpoints against consolidated ones: the same N-D run saved and loaded both ways.

A GPT (8 layers, width 384, ~15M parameters: 180 MB of fp32 weights and AdamW moments) trains
one step under the N-D strategy at data × tensor = 2 × 2 with ``zero=1`` on 4 gloo ranks, then
saves its Trainer checkpoint

* consolidated (the reference): the ZeRO shards and tensor-parallel slices are gathered, rank 0
  writes one ``torch.save`` file;
* sharded (``sharded_checkpoints=True``): every rank writes its own shards with
  ``torch.distributed.checkpoint``, nothing is gathered;

and loads each back into the live layout (the resume path: a consolidated file sliced to each
rank, or each rank reading its boxes). Reported: best of 3 wall seconds per save and per load
(ratio > 1: sharded is faster) and the bytes the busiest rank writes -- the wall a model that
needs sharding hits first. On 2 shared CPU cores the four ranks compete for the cores, so the
times are for the ratio only.

    python -m benchmarks.checkpoint [--world 4] [--repeats 3] [--smoke]

``--smoke``: 2 ranks (data 1 × tensor 2), a 1-layer model of width 32, one repeat.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Row, parse_args, report
from llmlab.parallel.launch import run_distributed

MODEL = dict(vocab_size=4096, block_size=64, n_layer=8, n_head=6, n_embd=384, dropout=0.0)
SMOKE_MODEL = dict(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
BATCH, T = 8, 64


def _trained_trainer(world: int, model: dict[str, Any]) -> Any:
    """A Trainer that has run one step of the N-D strategy (so AdamW holds its moments)."""
    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from torch.utils.data import DataLoader

    from llmlab.parallel.strategy import NDParallelStrategy
    from llmlab.train.task import CausalLMTask

    os.environ["WORLD_SIZE"] = str(world)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model["vocab_size"], (2, BATCH // 2, T + 1), generator=g)
    loader = DataLoader([(b[:, :-1], b[:, 1:]) for b in ids], batch_size=None)
    strategy = NDParallelStrategy(data=world // 2, tensor=2, zero=1, timeline_every_n_steps=0)
    strategy.cluster_environment = LightningEnvironment()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    task = CausalLMTask(model=dict(model), warmup_steps=1, max_steps=10)
    trainer.fit(task, train_dataloaders=loader)
    return trainer


def _rank(rank: int, world: int, root: str, repeats: int, model: dict) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    trainer = _trained_trainer(world, model)
    strategy = trainer.strategy
    paths = {"sharded": Path(root) / "sharded.ckpt", "consolidated": Path(root) / "full.ckpt"}

    def save(kind: str) -> None:
        strategy.checkpointer.sharded = kind == "sharded"  # the format this save writes
        trainer.save_checkpoint(paths[kind])

    def load(kind: str) -> None:
        checkpoint = strategy.load_checkpoint(paths[kind])
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)

    times: dict[str, float] = {}
    for what, fn in (("save", save), ("load", load)):
        for kind in ("consolidated", "sharded"):
            fn(kind)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn(kind)
                dist.barrier()
                best = min(best, time.perf_counter() - start)
            times[f"{what}/{kind}"] = best
    written = {
        "sharded": max(p.stat().st_size for p in paths["sharded"].glob("*.distcp")),
        "consolidated": paths["consolidated"].stat().st_size,
    }
    params = sum(p.numel() for p in trainer.lightning_module.model.parameters())
    return {"times": times, "written": written, "local_params": params}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint")
    parser.add_argument("--world", type=int, default=4, help="ranks: data (world/2) × tensor 2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser, argv)
    model = SMOKE_MODEL if args.smoke else MODEL
    if args.smoke:
        args.world, args.repeats = 2, 1
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_rank, args.world, root, args.repeats, model, timeout=1800)
    times = {k: max(r["times"][k] for r in results) for k in results[0]["times"]}
    written = results[0]["written"]
    layout = f"{args.world // 2}x1x2 zero=1, {args.world} ranks"
    rows = [
        Row(f"save ({layout})", times["save/sharded"], times["save/consolidated"],
            "consolidated", "s", higher_is_better=False),
        Row(f"load into the same layout ({layout})", times["load/sharded"],
            times["load/consolidated"], "consolidated", "s", higher_is_better=False),
        Row("bytes written by the busiest rank", written["sharded"], written["consolidated"],
            "consolidated (rank 0)", "bytes", higher_is_better=False),
    ]  # fmt: skip
    report(
        "checkpoint",
        rows,
        notes=(
            f"GPT {model['n_layer']}x{model['n_embd']}, vocab {model['vocab_size']}; "
            "best of "
            f"{args.repeats}, slowest rank; the consolidated file holds weights and AdamW state "
            "of the whole model, each shard file about 1/world of it"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
