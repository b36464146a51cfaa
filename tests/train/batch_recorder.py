"""A callback that writes down every training batch a rank saw, with its data-parallel rank.

The data tests add it to real app runs through a Hydra override
(``+callbacks.batches._target_=tests.train.batch_recorder.BatchRecorder``) and rebuild the
global batches of a parallel run from the ranks' files, to compare them with one process's.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch


class BatchRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.inputs: list[torch.Tensor] = []
        self.documents: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)
        self.inputs.append(batch[0].detach().cpu().clone())
        if len(batch) > 2:
            self.documents.append(batch[2].detach().cpu().clone())

    def on_train_end(self, trainer, pl_module) -> None:
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        record = {
            "steps": self.steps,
            "inputs": self.inputs,
            "documents": self.documents,
            "data_rank": int(kwargs.get("rank", 0)),
            "data_replicas": int(kwargs.get("num_replicas", 1)),
            "global_rank": trainer.global_rank,
        }
        out = Path(os.environ["LLMLAB_RUN_DIR"]) / "batches"
        out.mkdir(exist_ok=True)
        n = len(list(out.glob(f"rank{trainer.global_rank}-*.pt")))
        torch.save(record, out / f"rank{trainer.global_rank}-{n}.pt")
