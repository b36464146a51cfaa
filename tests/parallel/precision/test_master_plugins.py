"""fp16/bf16 master-weight plugins inside a real Lightning Trainer on the CPU.

Oracles: torch.optim.AdamW on fp32 weights fed the unscaled fp16 gradients (one step must match
bit for bit); Lightning's own ``bf16-true`` (which loses small updates that masters keep).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from llmlab.models import GPT, GPTConfig
from llmlab.parallel.precision import BF16MasterPrecision, FP16MasterPrecision
from tests.helpers.tiny import quiet_trainer, tiny_gpt_config

CFG = tiny_gpt_config(n_layer=1)


class TinyLM(L.LightningModule):
    """A one-block GPT; ``inject`` puts inf/nan into a gradient at the given global steps."""

    def __init__(self, inject: dict[int, float] | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**CFG))
        self.inject = inject or {}
        self.lr = lr
        self.logits_dtypes: list[torch.dtype] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x)
        self.logits_dtypes.append(logits.dtype)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    def on_after_backward(self) -> None:
        if self.global_step in self.inject:
            self.model.blocks[0].mlp.fc.weight.grad[0, 0] = self.inject[self.global_step]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def loader(n_batches: int = 3, batch: int = 4, same_batches: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    shape = (batch if same_batches else n_batches * batch, CFG["block_size"] + 1)
    tokens = torch.randint(0, CFG["vocab_size"], shape, generator=g)
    if same_batches:
        tokens = tokens.repeat(n_batches, 1)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def trainer(plugin: Any, max_steps: int, callbacks: list | None = None, **kw: Any) -> L.Trainer:
    return quiet_trainer(
        max_steps=max_steps,
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
        **kw,
    )


def snapshot(module: TinyLM, plugin: FP16MasterPrecision) -> dict[str, Any]:
    opt = module.trainer.optimizers[0]
    return {
        "model": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
        "masters": [m.detach().clone() for m in plugin.masters.masters],
        "opt": copy.deepcopy(opt.state_dict()["state"]),
    }


def assert_bit_identical(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bit_identical(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bit_identical(x, y)
    else:
        assert a == b


class Recorder(L.Callback):
    def __init__(self, plugin: FP16MasterPrecision) -> None:
        self.plugin = plugin
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, *_: Any) -> None:
        self.before[trainer.global_step] = snapshot(module, self.plugin)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *_: Any) -> None:
        step = trainer.global_step - 1
        self.after[step] = snapshot(module, self.plugin)
        self.scales.append(self.plugin.scaler.scale)
        for p in [*module.model.parameters(), *self.plugin.masters.masters]:
            assert torch.isfinite(p).all(), f"non-finite weight after step {step}"


def test_fp16_master_layout_on_cpu() -> None:
    """fp16 weights and compute on CPU (where Lightning's 16-mixed would quietly be bf16),
    fp32 masters in the optimizer, fp32 Adam state."""
    plugin = FP16MasterPrecision()
    module = TinyLM()
    t = trainer(plugin, max_steps=2)
    t.fit(module, loader())
    assert set(module.logits_dtypes) == {torch.float16}
    assert all(p.dtype == torch.float16 for p in module.model.parameters())
    opt = t.optimizers[0]
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    assert [id(p) for p in opt_params] == [id(m) for m in plugin.masters.masters]
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    # the fp16 model is the rounded masters
    for p, m in zip(plugin.masters.model_params, plugin.masters.masters, strict=True):
        assert torch.equal(p, m.to(torch.float16))
    assert t.callback_metrics["precision/loss_scale"].item() == plugin.scaler.scale
    assert t.callback_metrics["precision/skipped_steps"].item() == 0
    # validate after fit runs setup again: the masters (and their fp32 values) must survive
    masters, values = plugin.masters, [m.detach().clone() for m in plugin.masters.masters]
    t.validate(module, loader(), verbose=False)
    assert plugin.masters is masters
    assert all(torch.equal(a, b) for a, b in zip(values, masters.masters, strict=True))


def test_first_step_matches_adamw_on_unscaled_fp16_grads() -> None:
    """Oracle: torch AdamW on an fp32 copy of the initial weights, fed float32(g16) / S."""
    plugin = FP16MasterPrecision(init_scale=1024.0)
    module = TinyLM()
    ref_fp32 = copy.deepcopy(module.model)  # the fp32 initial weights the masters start from
    ref_fp16 = copy.deepcopy(module.model).half()
    x, y = next(iter(loader()))
    logits = ref_fp16(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    (loss.float() * 1024.0).backward()
    for p32, p16 in zip(ref_fp32.parameters(), ref_fp16.parameters(), strict=True):
        p32.grad = p16.grad.float() / 1024.0
    torch.optim.AdamW(ref_fp32.parameters(), lr=1e-2, weight_decay=0.1).step()

    trainer(plugin, max_steps=1).fit(module, loader())
    for m, r in zip(plugin.masters.masters, ref_fp32.parameters(), strict=True):
        assert torch.equal(m, r)
    for p, r in zip(module.model.parameters(), ref_fp32.parameters(), strict=True):
        assert torch.equal(p, r.half())


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_injected_overflow_skips_the_step_exactly(bad: float) -> None:
    plugin = FP16MasterPrecision(init_scale=256.0, hysteresis=1, growth_interval=1000)
    module = TinyLM(inject={2: bad})
    rec = Recorder(plugin)
    t = trainer(plugin, max_steps=5, callbacks=[rec])
    t.fit(module, loader())
    # step 2: weights (fp16 model and fp32 masters) and Adam state bit-identical to before it
    assert_bit_identical(rec.before[2], rec.after[2])
    assert rec.scales == [256.0, 256.0, 128.0, 128.0, 128.0]
    assert plugin.skipped_steps == 1
    # training continues: the next steps change the weights again
    assert not torch.equal(rec.after[3]["masters"][0], rec.after[2]["masters"][0])
    assert all(p.grad is None for p in module.model.parameters())
    assert t.callback_metrics["precision/skipped_steps"].item() == 1
    assert t.callback_metrics["precision/loss_scale"].item() == 128.0


def test_overflowing_scale_backs_off_until_training_runs() -> None:
    """An absurd initial scale overflows fp16 for real; the scaler finds a working one."""
    plugin = FP16MasterPrecision(init_scale=2.0**30, hysteresis=1)
    module = TinyLM()
    rec = Recorder(plugin)
    trainer(plugin, max_steps=24, callbacks=[rec]).fit(module, loader())
    assert 0 < plugin.skipped_steps < 24
    assert plugin.scaler.scale < 2.0**30
    assert len(set(rec.scales[-5:])) == 1  # settled: the last steps all stepped
    assert plugin.skipped_steps == round(math.log2(2.0**30 / plugin.scaler.scale))


def test_resume_restores_scaler_and_masters_exactly(tmp_path: Path) -> None:
    # Every batch is the same, because Lightning restarts a plain DataLoader's epoch on resume
    # (the batch order would differ for reasons that have nothing to do with precision).
    kwargs = dict(init_scale=2.0**12, growth_interval=2, hysteresis=2)
    inject = {1: math.inf, 4: math.inf}
    data = loader(same_batches=True)
    straight = FP16MasterPrecision(**kwargs)
    trainer(straight, max_steps=6).fit(TinyLM(inject=inject), data)

    first = FP16MasterPrecision(**kwargs)
    t1 = trainer(first, max_steps=3)
    t1.fit(TinyLM(inject=inject), data)
    ckpt = tmp_path / "half.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["FP16MasterPrecision"]
    assert saved["scaler"]["hysteresis_left"] == first.scaler.hysteresis_left

    resumed = FP16MasterPrecision(init_scale=1.0)  # state, not constructor, decides
    trainer(resumed, max_steps=6).fit(TinyLM(inject=inject), data, ckpt_path=str(ckpt))
    for key in ("scale", "growth_tracker", "hysteresis_left", "overflows"):
        assert resumed.scaler.state_dict()[key] == straight.scaler.state_dict()[key], key
    assert resumed.skipped_steps == straight.skipped_steps == 2
    for a, b in zip(resumed.masters.masters, straight.masters.masters, strict=True):
        assert torch.equal(a, b)


def test_bf16_masters_keep_updates_that_pure_bf16_rounds_away() -> None:
    """lr·grad = 1e-3 is below half of bf16's spacing at 1.0 (2**-8): pure bf16 never moves."""

    class One(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def training_step(self, batch: Any, idx: int) -> Tensor:
            return (self.w * batch[0].to(self.w.dtype)).sum()  # d loss / d w = 1

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(torch.ones(10, 1)), batch_size=1)
    pure = One()
    trainer(None, max_steps=10, precision="bf16-true").fit(pure, data)
    assert pure.w.dtype == torch.bfloat16 and pure.w.item() == 1.0

    plugin = BF16MasterPrecision()
    master = One()
    trainer(plugin, max_steps=10).fit(master, data)
    assert master.w.dtype == torch.bfloat16
    assert plugin.masters.masters[0].item() == pytest.approx(0.99, abs=1e-6)
    assert master.w.item() == torch.tensor(0.99).to(torch.bfloat16).item()


def test_plugin_rejects_bad_options() -> None:
    from llmlab.parallel.precision import MasterWeightPrecision

    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        MasterWeightPrecision("float8")
    with pytest.raises(ValueError, match="loss_scale must be"):
        MasterWeightPrecision("float16", loss_scale="auto")
    with pytest.raises(ValueError, match="growth_interval"):
        FP16MasterPrecision(growth_interval=0)
