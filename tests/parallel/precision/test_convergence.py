"""Done-when 3: fp16-master / bf16 / fp8 training tracks fp32 on the default corpus.

One GPT; for each seed, one data order and one initialisation shared by every precision, so only
the precision plugin changes. The full comparison (300 steps, three seeds) is ``slow``; a 30-step
version with a loose bound stays in the default suite. Run
``python -m tests.parallel.precision.test_convergence [steps]`` for the table.

The issue's criterion is one seed (1337): fp16-master, bf16-master and fp8 are bounded there.
Lightning's autocast ``bf16-mixed`` is bounded on the median over five seeds, because at 300 steps
this small model sits on a plateau (val ~3.3, the bigram stage) for a while and *when* it leaves
is chaotic: fp32 alone ends between 2.65 and 2.73 across seeds, and two fp32 runs whose first
steps agree to 5 digits drift 0.3% apart through summation order alone. With seed 1337,
bf16-mixed left the plateau ~60 steps after fp32 and ended +6.6%; on seeds 1-4 it is within
-0.2%..+0.7% of fp32. One seed measures that luck, not the precision.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from llmlab.parallel.precision import BF16MasterPrecision, FP8Precision, FP16MasterPrecision
from llmlab.train.data import corpus_files
from llmlab.train.task import CausalLMTask
from tests.helpers.tiny import quiet_trainer

MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
BATCH, SEED = 8, 1337
SEEDS = (1337, 1, 2, 3, 4)  # bf16-mixed is bounded on the median over these


def precision_setup(name: str) -> dict[str, Any]:
    """Trainer arguments for one precision choice (what conf/precision/*.yaml select)."""
    if name == "fp32":
        return {"precision": "32-true"}
    if name == "fp16-master":
        return {"plugins": [FP16MasterPrecision()]}
    if name == "bf16-master":
        return {"plugins": [BF16MasterPrecision()]}
    if name == "bf16-mixed":
        return {"precision": "bf16-mixed"}
    if name == "fp8":  # d=32: the size filter must admit 32-wide layers to convert any
        return {"plugins": [FP8Precision(min_features=32, backend="emulate")]}
    raise ValueError(f"unknown precision {name!r}")


def _bytes(files: list[str], limit: int) -> torch.Tensor:
    data = b"".join(Path(f).read_bytes() for f in files)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def corpus_loaders(
    steps: int, val_batches: int = 16, seed: int = SEED
) -> tuple[DataLoader, DataLoader]:
    """Random windows of the train split (seeded, so every run sees the same order) and fixed
    windows of the held-out works."""
    files = corpus_files("shakespeare")
    train, val = _bytes(files["train"], 4_000_000), _bytes(files["validation"], 1_000_000)
    T = MODEL["block_size"]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - T - 1, (steps * BATCH,), generator=g)
    windows = torch.stack([train[s : s + T + 1] for s in starts.tolist()])
    vstarts = torch.linspace(0, len(val) - T - 2, val_batches * BATCH).long()
    vwindows = torch.stack([val[s : s + T + 1] for s in vstarts.tolist()])
    make = lambda w: DataLoader(TensorDataset(w[:, :-1], w[:, 1:]), batch_size=BATCH)  # noqa: E731
    return make(windows), make(vwindows)


def final_val_loss(name: str, steps: int, seed: int = SEED) -> float:
    """Train ``steps`` steps with precision ``name``; return the val loss."""
    L.seed_everything(seed, workers=True, verbose=False)
    train, val = corpus_loaders(steps, seed=seed)
    task = CausalLMTask(MODEL, lr=2e-3, warmup_steps=max(1, steps // 10), max_steps=steps)
    setup = precision_setup(name)
    trainer = quiet_trainer(
        max_steps=steps, gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, **setup
    )
    trainer.fit(task, train)
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(task, val, verbose=False)
    return float(metrics["val/loss"])


BOUNDS = {"fp16-master": 0.02, "bf16-master": 0.02, "fp8": 0.05}  # at SEED, as the issue says
MEDIAN_BOUNDS = {"bf16-mixed": 0.02}  # Lightning's autocast variant: median over SEEDS


def compare(steps: int, seeds: tuple[int, ...] = SEEDS) -> dict[str, list[float]]:
    """Final val loss of every precision, per seed (same seed = same data and init)."""
    return {
        name: [final_val_loss(name, steps, seed) for seed in seeds]
        for name in ("fp32", *BOUNDS, *MEDIAN_BOUNDS)
    }


def relative(a: float, b: float) -> float:
    return (a - b) / b


@pytest.mark.slow
def test_300_steps_within_bounds_of_fp32() -> None:
    results = compare(300)
    at_seed = {name: losses[SEEDS.index(SEED)] for name, losses in results.items()}
    for name, bound in BOUNDS.items():
        rel = relative(at_seed[name], at_seed["fp32"])
        assert abs(rel) <= bound, f"{name}: {at_seed[name]:.4f} vs fp32 {at_seed['fp32']:.4f}"
    for name, bound in MEDIAN_BOUNDS.items():
        rel = relative(statistics.median(results[name]), statistics.median(results["fp32"]))
        assert abs(rel) <= bound, f"{name}: {results[name]} vs fp32 {results['fp32']}"


def test_30_steps_track_fp32_loosely() -> None:
    """Short version: 30 steps, the fast precisions only (fp16 is the slow one on CPU)."""
    ref = final_val_loss("fp32", 30)
    for name in ("bf16-master", "fp8"):
        loss = final_val_loss(name, 30)
        assert abs(loss - ref) / ref < 0.1, f"{name}: {loss:.4f} vs fp32 {ref:.4f}"


if __name__ == "__main__":
    # One thread: on a shared, oversubscribed CPU, OpenMP threads spin waiting for each other.
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    start = time.perf_counter()
    results = compare(n)
    at = SEEDS.index(SEED)
    print(f"\n{n} steps, GPT {MODEL}, batch {BATCH}, seeds {SEEDS}")
    seed_col = f"seed {SEED}"
    print(f"{'precision':<12} {seed_col:>9} {'vs fp32':>8} {'median':>7} {'vs fp32':>8}  per seed")
    for name, losses in results.items():
        rel = relative(losses[at], results["fp32"][at])
        med = statistics.median(losses)
        med_rel = relative(med, statistics.median(results["fp32"]))
        per_seed = "  ".join(f"{x:.4f}" for x in losses)
        print(
            f"{name:<12} {losses[at]:>9.4f} {rel:>+8.2%} {med:>7.4f} {med_rel:>+8.2%}  {per_seed}"
        )
    print(f"{time.perf_counter() - start:.0f} s")
