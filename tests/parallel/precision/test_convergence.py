"""Done-when 3: fp16-master / bf16 / fp8 training tracks fp32 on the default corpus.

One GPT, one data order, one seed; only the precision plugin changes. The full comparison
(300 steps) is ``slow``; a 30-step version with a loose bound stays in the default suite.
Run ``python -m tests.parallel.precision.test_convergence [steps]`` for the table.

Sized for these CPUs: an fp16 matmul is ~70× slower than fp32 here, so the model is small
(2 layers, d=32, T=64, batch 8); the same comparison at full size is for GPUs.
"""

from __future__ import annotations

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

MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
BATCH, SEED = 8, 1337


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


def corpus_loaders(steps: int, val_batches: int = 16) -> tuple[DataLoader, DataLoader]:
    """Random windows of the train split (seeded, so every run sees the same order) and fixed
    windows of the held-out works."""
    files = corpus_files("shakespeare")
    train, val = _bytes(files["train"], 4_000_000), _bytes(files["validation"], 1_000_000)
    T = MODEL["block_size"]
    g = torch.Generator().manual_seed(SEED)
    starts = torch.randint(0, len(train) - T - 1, (steps * BATCH,), generator=g)
    windows = torch.stack([train[s : s + T + 1] for s in starts.tolist()])
    vstarts = torch.linspace(0, len(val) - T - 2, val_batches * BATCH).long()
    vwindows = torch.stack([val[s : s + T + 1] for s in vstarts.tolist()])
    make = lambda w: DataLoader(TensorDataset(w[:, :-1], w[:, 1:]), batch_size=BATCH)  # noqa: E731
    return make(windows), make(vwindows)


def final_val_loss(name: str, steps: int) -> tuple[float, float, dict[str, float]]:
    """Train ``steps`` steps with precision ``name``; return (val loss, seconds, extras)."""
    L.seed_everything(SEED, workers=True, verbose=False)
    train, val = corpus_loaders(steps)
    task = CausalLMTask(MODEL, lr=2e-3, warmup_steps=max(1, steps // 10), max_steps=steps)
    setup = precision_setup(name)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **setup,
    )
    start = time.perf_counter()
    trainer.fit(task, train)
    seconds = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(task, val, verbose=False)
    extras = {}
    plugin = (setup.get("plugins") or [None])[0]
    if isinstance(plugin, FP16MasterPrecision):
        extras = {"loss_scale": plugin.scaler.scale, "skipped_steps": plugin.skipped_steps}
    return float(metrics["val/loss"]), seconds, extras


BOUNDS = {"fp16-master": 0.02, "bf16-master": 0.02, "fp8": 0.05}
# Lightning's own autocast plugin, measured for comparison but not ours to bound: it came out
# +6.6% over fp32 at 300 steps here (bf16-master: +0.5%; plain torch.autocast bf16 in a hand
# loop: +0.9%), see the README section on mixed precision.
REPORTED = ("bf16-mixed",)


def compare(steps: int) -> dict[str, tuple[float, float, dict[str, float]]]:
    return {name: final_val_loss(name, steps) for name in ("fp32", *BOUNDS, *REPORTED)}


@pytest.mark.slow
def test_300_steps_within_bounds_of_fp32() -> None:
    results = {name: final_val_loss(name, 300) for name in ("fp32", *BOUNDS)}
    ref = results["fp32"][0]
    for name, bound in BOUNDS.items():
        rel = abs(results[name][0] - ref) / ref
        assert rel <= bound, f"{name}: val loss {results[name][0]:.4f} vs fp32 {ref:.4f}"


def test_30_steps_track_fp32_loosely() -> None:
    """Short version: 30 steps, the fast precisions only (fp16 is the slow one on CPU)."""
    ref, _, _ = final_val_loss("fp32", 30)
    for name in ("bf16-master", "fp8"):
        loss, _, _ = final_val_loss(name, 30)
        assert abs(loss - ref) / ref < 0.1, f"{name}: {loss:.4f} vs fp32 {ref:.4f}"


if __name__ == "__main__":
    # One thread: on a shared, oversubscribed CPU, OpenMP threads spin waiting for each other.
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    results = compare(n)
    ref = results["fp32"][0]
    print(f"\n{n} steps, GPT {MODEL}, batch {BATCH}, seed {SEED}")
    print(f"{'precision':<12} {'val loss':>9} {'vs fp32':>8} {'bound':>6} {'seconds':>8}  extras")
    for name, (loss, secs, extras) in results.items():
        rel = (loss - ref) / ref
        bound = f"{BOUNDS[name]:.0%}" if name in BOUNDS else ""
        print(f"{name:<12} {loss:>9.4f} {rel:>+8.2%} {bound:>6} {secs:>8.1f}  {extras}")
