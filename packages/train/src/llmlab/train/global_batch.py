"""The one rule that splits a global batch over data-parallel replicas, for every data module.

``data.batch_size`` is the *global* batch ``B``. A strategy reports its data-parallel size ``R``
and this process's data-parallel rank ``r`` through ``distributed_sampler_kwargs`` (pipeline and
tensor-parallel ranks of one replica report the same ``r``: they must see the same rows), and:

* every replica orders the split the same way, from the seed and the epoch only
  (:class:`~llmlab.train.resumable.ResumableSampler`);
* replica ``r`` takes positions ``r, r + R, r + 2R, ...`` of that order, ``B / R`` per step.

So global batch ``k`` is positions ``[kB, (k+1)B)`` whatever ``R`` is: a run on any number of
processes sees the batches one process would (row ``j`` of the single-process batch is row
``j // R`` of replica ``j % R``), and a checkpoint that records "``k`` global batches of epoch
``e`` done" resumes at any ``R`` (each replica skips ``k·B/R`` of its positions).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset

from llmlab.train.resumable import ResumableDataLoader, ResumableSampler


class GlobalBatchDataModule(L.LightningDataModule):
    """Base of the data modules: ``loader(split, replicas, rank)`` by the rule above.

    A subclass provides ``split_dataset(split)``, ``collate(rows)``, and may override
    ``sampler(...)`` (the order of a split) and ``identity()`` (what a resumed run must share).
    """

    def __init__(self, batch_size: int, seed: int) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"data.batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size = batch_size
        self.seed = seed

    def split_dataset(self, split: str) -> Dataset:
        raise NotImplementedError

    def collate(self, rows: list[Any]) -> Any:
        raise NotImplementedError

    def sampler(self, dataset: Dataset, split: str, replicas: int, rank: int) -> ResumableSampler:
        """The train split shuffled by a permutation of the seed and epoch; others in order."""
        shuffle = split == "train"
        return ResumableSampler(
            dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=self.seed,
            drop_last=True,
        )  # fmt: skip

    def identity(self) -> dict[str, Any] | None:
        """What decides the order of the train batches, checked when a run resumes."""
        return None

    def _replicas(self) -> tuple[int, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def per_replica_batch_size(self, replicas: int) -> int:
        if self.batch_size % replicas != 0:
            raise ValueError(
                f"data.batch_size={self.batch_size} (global) is not divisible by the "
                f"{replicas} data-parallel replicas; use a multiple of {replicas}"
            )
        return self.batch_size // replicas

    def loader(self, split: str, replicas: int = 1, rank: int = 0) -> DataLoader:
        """Batches of ``split`` for data-parallel replica ``rank`` of ``replicas``; the train
        loader is checkpointed so a mid-epoch resume continues where the run stopped."""
        dataset = self.split_dataset(split)
        kwargs: dict[str, Any] = dict(
            batch_size=self.per_replica_batch_size(replicas),
            sampler=self.sampler(dataset, split, replicas, rank),
            drop_last=True,
            collate_fn=self.collate,
        )
        if split == "train":
            return ResumableDataLoader(
                dataset, progress=self._train_progress, identity=self.identity(), **kwargs
            )
        return DataLoader(dataset, **kwargs)

    def _train_progress(self) -> tuple[int, int]:
        """(epoch, train batches of it finished): what a checkpoint must remember."""
        trainer = self.trainer
        if trainer is None:
            return 0, 0
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", *self._replicas())

    def val_dataloader(self) -> DataLoader:
        return self.loader("validation", *self._replicas())
