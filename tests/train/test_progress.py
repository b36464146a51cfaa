"""The training progress bar of ``callbacks/default.yaml``: labelled by steps when
``max_steps`` bounds the run (Lightning's own label read "Epoch 0/-2" there), by epochs when
``max_epochs`` does."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from llmlab.train.progress import StepProgressBar
from tests.helpers.tiny import quiet_trainer, tiny_task, tiny_tokens


class Labels(L.Callback):
    """Records the training bar's label after every batch (placed after the bar)."""

    def __init__(self, bar: RichProgressBar) -> None:
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, *args: object) -> None:
        task = self.bar.progress.tasks[self.bar.train_progress_bar_id]
        self.seen.append(task.description.strip())


def _labels(bar: RichProgressBar, **limits: int) -> list[str]:
    labels = Labels(bar)
    trainer = quiet_trainer(enable_progress_bar=True, callbacks=[bar, labels],
                            limit_val_batches=0, **limits)  # fmt: skip
    trainer.fit(tiny_task(max_steps=3), datamodule=tiny_tokens(2))
    return labels.seen


def test_a_run_bounded_by_steps_is_labelled_by_steps():
    assert _labels(RichProgressBar(), max_steps=3)[0] == "Epoch 0/-2"  # Lightning's own
    # 2 batches per epoch, 3 steps: the label follows the steps across the epoch boundary
    assert _labels(StepProgressBar(), max_steps=3) == ["Step 1/3", "Step 2/3", "Step 3/3"]


def test_a_run_bounded_by_epochs_keeps_lightnings_label():
    assert _labels(StepProgressBar(), max_epochs=2) == ["Epoch 0/1"] * 2 + ["Epoch 1/1"] * 2


def test_the_default_callbacks_use_it():
    from llmlab.train.compose import compose_config

    cfg = compose_config([])
    assert cfg.callbacks.progress_bar._target_ == "llmlab.train.progress.StepProgressBar"
