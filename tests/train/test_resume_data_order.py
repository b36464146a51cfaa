"""A run resumed from a mid-epoch checkpoint trains on exactly the batches an uninterrupted run
would: no batch replayed, none skipped (Lightning restarts a plain loader's epoch instead)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader

from llmlab.train.data import TextDataModule
from llmlab.train.resumable import ResumableSampler
from tests.helpers.tiny import quiet_trainer
from tests.train.text_module import make_module


class RecordBatches(L.LightningModule):
    """Trains a scalar on the batch and remembers which blocks each step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, _ = batch
        self.seen.append(inputs[:, :4].sum(1).tolist())  # identifies each block of the batch
        return (self.w - inputs.float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit(data: TextDataModule, root, max_steps: int, ckpt_path: str | None = None, **kw):
    model = RecordBatches()
    trainer = quiet_trainer(
        max_steps=max_steps,
        default_root_dir=str(root),
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=True)],
        enable_checkpointing=True,
        **kw,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize(
    "stop_at, accumulate",
    [(3, 1), (9, 1), (12, 1), (4, 2)],  # mid-epoch 0, epoch end, mid-epoch 1, with accumulation
)
def test_resumed_run_sees_the_uninterrupted_batches(tmp_path, stop_at, accumulate):
    data = make_module(tmp_path, batch_size=32)  # 9 batches per epoch
    batches_per_epoch = len(data.loader("train"))
    assert batches_per_epoch == 9
    total = 15
    expected = fit(data, tmp_path / "a", total, accumulate_grad_batches=accumulate)
    first = fit(data, tmp_path / "b", stop_at, accumulate_grad_batches=accumulate)
    rest = fit(
        data,
        tmp_path / "b",
        total,
        str(tmp_path / "b" / "last.ckpt"),
        accumulate_grad_batches=accumulate,
    )
    assert first + rest == expected[: len(first) + len(rest)]
    assert len(first) + len(rest) == len(expected)


def test_plain_loader_would_replay_the_epoch(tmp_path, monkeypatch):
    """The control: without the loader's state, the resumed run repeats the epoch's start."""
    data = make_module(tmp_path, batch_size=32)
    expected = fit(data, tmp_path / "a", 6)
    monkeypatch.setattr(
        TextDataModule,
        "train_dataloader",
        lambda self: DataLoader(
            self.splits["train"],
            batch_size=32,
            sampler=ResumableSampler(self.splits["train"], 1, 0, shuffle=True, seed=self.seed),
            collate_fn=data.loader("train").collate_fn,
        ),
    )
    first = fit(data, tmp_path / "b", 3)
    rest = fit(data, tmp_path / "b", 6, str(tmp_path / "b" / "last.ckpt"))
    assert first == expected[:3]
    assert rest[0] == expected[0] != expected[3]
