"""``NaiveModelParallelStrategy``: the one-process split is applied by the strategy, not the task,
and trains exactly as the unsplit model does (same losses, same weights, 1e-6). Micro-batching
changes BatchNorm's batch statistics, so its oracle is gradient accumulation over the same
micro-batches (tests/parallel/pipeline/test_resnet_pipeline.py), not the unsplit batch."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from llmlab.parallel.pipeline.naive import ModelParallel, NaiveModelParallelStrategy
from llmlab.train.vision import ImageClassificationTask


def _fit(strategy) -> tuple[list[float], dict[str, torch.Tensor], ImageClassificationTask]:
    L.seed_everything(0)
    task = ImageClassificationTask(model={"num_classes": 4, "in_channels": 3}, max_steps=3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(3)]  # fmt: skip
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(task, train_dataloaders=DataLoader(data, batch_size=None))
    params = {
        k.replace("parts.0.", "").replace("parts.1.", ""): v for k, v in task.state_dict().items()
    }
    return losses, params, task


def test_the_strategy_splits_the_model_and_trains_as_the_unsplit_one():
    ref_losses, ref_params, _ = _fit("auto")
    losses, params, task = _fit(NaiveModelParallelStrategy(devices=["cpu", "cpu"]))
    assert isinstance(task.model, ModelParallel) and len(task.model.parts) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
    assert len(params) == len(ref_params)
    for (k, v), ref in zip(params.items(), ref_params.values()):
        torch.testing.assert_close(v, ref, atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=["cpu"]), r"at least two devices to split over, got \['cpu'\]"),
        (dict(microbatches=0), "strategy.microbatches must be a positive integer, got 0"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NaiveModelParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["precision=fp16_master"], "precision=FP16MasterPrecision"),
        (["precision=bf16_mixed"], "precision=bf16-mixed"),
        (["+model_transforms.activation_checkpointing=1"], "activation_checkpointing"),
    ],
)
def test_unchecked_combinations_are_refused_by_config_validation(overrides, named):
    from llmlab.train.app import ConfigError, compose_config, validate_config

    cfg = compose_config(["experiment=resnet50_naive_mp", *overrides])
    with pytest.raises(ConfigError, match=f"strategy=naive_mp was checked .*{named}"):
        validate_config(cfg)
