"""MFU on a known configuration (GPT-2 small), checked against numbers nobody here computed.

FLOPs per token follow PaLM (appendix B) as nanoGPT's ``estimate_mfu`` does: 6·N + 12·L·d·T,
with N the parameters excluding position embeddings (tied input/output embedding counted once).
Oracles: HF ``transformers``' GPT-2 parameter count for N, and nanoGPT's published figure for
GPT-2 124M ("number of parameters: 123.65M"). Tolerance: exact (integer arithmetic).
"""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.models import GPT, GPTConfig
from llmlab.train.telemetry import (
    GPU_PEAK_FLOPS,
    TrainingTelemetry,
    cached_cpu_peak_flops,
    measure_cpu_peak_flops,
    mfu,
)
from tests.helpers.tiny import quiet_trainer

GPT2_SMALL = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


@pytest.fixture(scope="module")
def gpt2_small() -> GPT:
    with torch.device("meta"):  # shapes only: no 500 MB of weights on a 2-core box
        return GPT(GPTConfig(**GPT2_SMALL))


def test_parameter_count_matches_hf_gpt2(gpt2_small):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12))
    n_hf = hf.num_parameters()  # tied lm_head counted once: 124,439,808
    assert n_hf == 124_439_808
    non_embedding = n_hf - hf.transformer.wpe.weight.numel()
    assert gpt2_small.num_params() == non_embedding == 123_653_376  # nanoGPT: "123.65M"


def test_flops_per_token_of_gpt2_small(gpt2_small):
    # 6 · 123,653,376 + 12 · 12 layers · 768 · 1024 tokens of context
    expected = 6 * 123_653_376 + 12 * 12 * 768 * 1024
    assert expected == 855_166_464
    assert gpt2_small.flops_per_token() == expected


def test_mfu_worked_example_a100():
    # GPT-2 small at 100k tokens/s on one A100 (312 TFLOP/s dense bf16): 85.5 TFLOP/s achieved.
    value = mfu(100_000, 855_166_464, GPU_PEAK_FLOPS["A100"])
    assert value == pytest.approx(85_516_646_400_000 / 312e12, rel=1e-12)
    assert math.isclose(value, 0.274092, rel_tol=1e-6)
    # 8 GPUs at 8× the throughput: same utilisation
    assert mfu(800_000, 855_166_464, 8 * GPU_PEAK_FLOPS["A100"]) == pytest.approx(value)


def test_mfu_rejects_a_missing_peak():
    with pytest.raises(ValueError, match="peak_flops must be positive, got 0"):
        mfu(1.0, 1.0, 0.0)


def csv_rows(root) -> list[dict[str, str]]:
    import csv

    with open(root / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_telemetry_logs_every_metric_in_a_real_fit(tmp_path):
    """tokens/s, samples/s, MFU, LR, grad norm and peak memory each step of a Lightning fit;
    MFU equals the formula applied to the logged throughput; grad norm equals torch's
    ``clip_grad_norm_`` total norm of the same gradients (pre-clipping)."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from llmlab.train.task import CausalLMTask

    cfg = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    seen: list[dict[str, float]] = []
    norms: list[float] = []

    class Spy(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (12, 17), generator=g)
    loader = torch.utils.data.DataLoader(
        list(zip(data[:, :-1], data[:, 1:])), batch_size=4, shuffle=False
    )
    task = CausalLMTask(model=cfg, lr=1e-3, warmup_steps=2, max_steps=3)
    peak = 1e9
    trainer = quiet_trainer(
        max_steps=3,
        logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[TrainingTelemetry(peak_flops_per_device=peak), Spy()],  # Spy reads after
        default_root_dir=tmp_path,
    )
    trainer.fit(task, loader)
    assert len(seen) == 3
    fpt = task.model.flops_per_token()
    for step, metrics in enumerate(seen):
        for key in ("train/tokens_per_sec", "train/samples_per_sec", "train/mfu", "train/lr",
                    "train/grad_norm", "sys/peak_memory_mb"):  # fmt: skip
            assert key in metrics, (step, key)
        assert metrics["train/tokens_per_sec"] == pytest.approx(
            16 * metrics["train/samples_per_sec"], rel=1e-5
        )
        assert metrics["train/mfu"] == pytest.approx(
            metrics["train/tokens_per_sec"] * fpt / peak, rel=1e-5
        )
        # warmup 2 steps then cosine over 1 step: multipliers 1/2, 2/2, then cos(0) = 1
        assert metrics["train/lr"] == pytest.approx([5e-4, 1e-3, 1e-3][step], rel=1e-6)
        assert metrics["train/grad_norm"] == pytest.approx(norms[step], rel=1e-5)
        assert metrics["sys/peak_memory_mb"] > 10  # a Python process with torch loaded
    logged = [r for r in csv_rows(tmp_path) if r.get("perf/peak_flops")]
    assert [float(r["perf/peak_flops"]) for r in logged] == [peak]  # once, the MFU denominator


def test_mfu_counts_the_whole_model_when_the_strategy_shards_it(tmp_path):
    """A strategy that keeps only part of the model on this rank (as pipeline stages and ZeRO-3
    shards do) runs ``setup`` after the callbacks' ``setup``: MFU must use the whole model's
    FLOPs per token, read before the strategy touched it."""
    import lightning as L
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from llmlab.train.task import CausalLMTask

    class KeepFirstBlock(SingleDeviceStrategy):
        def setup(self, trainer):
            self.lightning_module.model.blocks = self.lightning_module.model.blocks[:1]
            super().setup(trainer)

    cfg = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    task = CausalLMTask(model=cfg, warmup_steps=1, max_steps=2)
    whole = task.model.flops_per_token()
    seen: list[dict[str, float]] = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4)
    peak = 1e9
    trainer = quiet_trainer(
        strategy=KeepFirstBlock(device=torch.device("cpu")),
        max_steps=2,
        callbacks=[TrainingTelemetry(peak_flops_per_device=peak), Spy()],
        default_root_dir=tmp_path,
    )
    trainer.fit(task, loader)
    local = task.model.flops_per_token()
    assert local < 0.6 * whole  # control: the strategy really shrank the local model
    for metrics in seen:
        assert metrics["train/mfu"] == pytest.approx(
            metrics["train/tokens_per_sec"] * whole / peak, rel=1e-5
        )


def test_peak_probe_keeps_the_best_rate_this_machine_has_shown(tmp_path, monkeypatch):
    """The cached peak only moves up: a probe taken while the cores are busy (low) does not
    lower the MFU denominator; a better one raises it. One entry per machine key."""
    import json

    monkeypatch.setenv("LLMLAB_CACHE_DIR", str(tmp_path))
    assert cached_cpu_peak_flops(measured=1e9) == 1e9
    assert cached_cpu_peak_flops(measured=4e8) == 1e9  # a busy moment
    assert cached_cpu_peak_flops(measured=2e9) == 2e9
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cache.values()) == [2e9]
    assert "threads" in next(iter(cache))
    (tmp_path / "peak_flops.json").write_text("not json")  # a damaged cache loses only history
    assert cached_cpu_peak_flops(measured=3e8) == 3e8


def test_peak_probe_measures_a_plausible_matmul_rate():
    # Any CPU that runs this suite does between 0.1 and 10,000 GFLOP/s in fp32 matmul.
    rate = measure_cpu_peak_flops(sizes=(256,), rounds=2, repeats=2, pause=0.0)
    assert 1e8 < rate < 1e13
