"""A callback that writes down what a run logged, straight from Lightning (no W&B involved).

``tests/train/test_compare.py`` adds it to real training runs through a Hydra override
(``+callbacks.recorder._target_=tests.train.metric_recorder.MetricRecorder``) and checks
``make compare``'s numbers against this independent record of the same run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning as L

TRAIN_KEYS = ("train/loss", "train/tokens_per_sec", "train/mfu", "sys/peak_memory_mb")


class MetricRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.val_losses: list[float] = []
        self._fit_start = 0.0

    def on_fit_start(self, trainer, pl_module) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.steps.append({k: float(metrics[k]) for k in TRAIN_KEYS if k in metrics})

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val/loss"]))

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            record = {
                "steps": self.steps,
                "val_losses": self.val_losses,
                "fit_seconds": time.perf_counter() - self._fit_start,
            }
            Path(os.environ["LLMLAB_RUN_DIR"], "recorded_metrics.json").write_text(
                json.dumps(record)
            )
