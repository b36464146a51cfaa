"""The training progress bar: Lightning's ``RichProgressBar``, labelled by steps when steps
bound the run.

llmlab runs are bounded by ``trainer.max_steps``; Lightning then sets ``max_epochs=-1``
(unbounded), and ``RichProgressBar`` labels the bar ``Epoch {epoch}/{max_epochs - 1}``, which
reads "Epoch 0/-2". :class:`StepProgressBar` labels it ``Step {global_step}/{max_steps}``
instead, updated after every batch (the bar itself already counts the epoch's batches up to the
remaining steps: ``ProgressBar.total_train_batches``). A run bounded by epochs keeps
Lightning's label.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training label is ``Step 120/1100`` when ``max_steps`` bounds
    the run and epochs do not (module docstring)."""

    def _bounded_by_steps(self) -> bool:
        trainer = self.trainer
        unbounded_epochs = trainer.max_epochs is None or trainer.max_epochs < 0
        return unbounded_epochs and trainer.max_steps is not None and trainer.max_steps > 0

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._bounded_by_steps():
            return super()._get_train_description(current_epoch)
        text = f"Step {self.trainer.global_step}/{self.trainer.max_steps}"
        # as Lightning pads it: the same width as "Validation", so the bars do not jump
        return f"{text:{len(self.validation_description)}}"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar_id
        if self._bounded_by_steps() and self.progress is not None and bar is not None:
            description = self._get_train_description(trainer.current_epoch)
            self.progress.update(bar, description=description)
