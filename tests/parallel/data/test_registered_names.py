"""The data-parallel strategies are selectable by the names the README and ``conf/strategy/``
use: ``L.Trainer(strategy="bucketed" | "ps_sync" | "ps_async")``, as ``"nd"``, ``"pipeline"``
and ``"tensor"`` are. Constructing the Trainer is the test: an unregistered name is refused
there ("invalid strategy name"); no process group is started."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

from llmlab.parallel.data import BucketedDataParallelStrategy, ParameterServerStrategy

CONF = Path(__file__).resolve().parents[3] / "packages/train/src/llmlab/train/conf/strategy"


@pytest.mark.parametrize(
    "name, cls, mode",
    [
        ("bucketed", BucketedDataParallelStrategy, None),
        ("ps_sync", ParameterServerStrategy, "sync"),
        ("ps_async", ParameterServerStrategy, "async"),
    ],
)
def test_a_trainer_takes_the_strategy_by_name(name, cls, mode):
    assert name in StrategyRegistry
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    assert type(trainer.strategy) is cls and trainer.strategy.num_processes == 2
    if mode is not None:
        assert trainer.strategy.mode == mode
    # the Hydra group option of the same name builds the same class in the same mode
    option = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert option["_target_"].rsplit(".", 1)[1] == cls.__name__
    assert option.get("mode") == mode
