"""``EvalAfterTraining``: an experiment's eval tasks, run once training has finished.

It evaluates the run's last checkpoint (whatever layout wrote it: ``load_checkpoint`` gathers a
sharded one), on global rank zero, and logs ``eval/<task>/<metric>`` to the run's logger (the
live W&B run) and ``<run dir>/eval/last.json``. List it in an experiment::

    callbacks:
      eval:
        _target_: llmlab.train.evaluation.callback.EvalAfterTraining
        tasks: [shakespeare_bpb, shakespeare_cloze]
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from llmlab.train.evaluation.run import check_tasks

log = logging.getLogger(__name__)


class EvalAfterTraining(L.Callback):
    def __init__(
        self,
        tasks: list[str],
        limit: int | float | None = None,
        batch_size: int = 16,
        max_chars: int | None = None,
    ) -> None:
        """``tasks``: llmlab task names; ``limit``: documents per task (lm-eval's); ``max_chars``:
        keep the first characters of each ``shakespeare_bpb`` work (quick runs)."""
        check_tasks(list(tasks))  # before training starts, not after
        self.tasks = list(tasks)
        self.limit = limit
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.metrics: dict[str, float] = {}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "")
        if not checkpoint:
            raise RuntimeError(
                "EvalAfterTraining evaluates the last checkpoint: keep the checkpoint callback "
                "with save_last: true"
            )
        from llmlab.train.evaluation.run import evaluate, flat_metrics, table, write_json
        from llmlab.train.sample import load_checkpoint

        model, tokenizer = load_checkpoint(checkpoint)
        metadata = {"max_chars": self.max_chars} if self.max_chars else None
        results = evaluate(model, tokenizer, self.tasks, self.limit, self.batch_size, metadata)
        self.metrics = flat_metrics(results)
        log.info("Evaluation of %s:\n%s", checkpoint, table(results))
        write_json(results, Path(trainer.default_root_dir) / "eval" / "last.json")
        if trainer.logger is not None:
            trainer.logger.log_metrics(self.metrics, step=trainer.global_step)
