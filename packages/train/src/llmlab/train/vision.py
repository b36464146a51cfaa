"""Image classification for the model-parallel experiments: an offline data module and a task.

``ImageDataModule`` serves scikit-learn's bundled 8×8 handwritten digits (1,797 images, no
download) upsampled to ``image_size`` and repeated to three channels, so ResNet-50 runs on real
data on a machine without network; given ``dataset_name`` it loads any HF image-classification
dataset instead (``image``/``img`` and ``label`` columns; needs the network once). Like
``TextDataModule`` it shards the *global* ``batch_size`` by the data-parallel rank the strategy
reports in ``distributed_sampler_kwargs``, so every stage of a pipeline sees the same batch.

``ImageClassificationTask`` trains ``llmlab.models.ResNet50`` with cross-entropy; its ``model``
attribute and ``loss_fn`` follow the same contract as ``CausalLMTask``, so the pipeline strategy
pipelines it the same way.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric

from llmlab.models import ResNet50
from llmlab.parallel.loss_mean import global_token_mean, loss_replicas
from llmlab.train.task import adamw_warmup_cosine


def digits_tensors(image_size: int = 32) -> tuple[Tensor, Tensor]:
    """scikit-learn's digits as (N, 3, S, S) float images in [-1, 1] and (N,) labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) - 0.5) / 0.5
    return x.repeat(1, 3, 1, 1), torch.tensor(digits.target, dtype=torch.long)


def hf_image_tensors(name: str, split: str, image_size: int, cache_dir: str | None) -> tuple:
    """An HF image-classification split as tensors (needs the dataset once, online)."""
    import datasets
    import numpy as np

    ds = datasets.load_dataset(name, split=split, cache_dir=cache_dir)
    image_key = next((k for k in ("image", "img") if k in ds.column_names), None)
    label_key = next((k for k in ("label", "labels", "fine_label") if k in ds.column_names), None)
    if image_key is None or label_key is None:
        raise ValueError(
            f"dataset {name!r} needs an image column ('image' or 'img') and a label column "
            f"('label'); it has {ds.column_names}"
        )
    images = []
    for row in ds:
        arr = np.asarray(row[image_key].convert("RGB"), dtype=np.float32) / 255.0
        images.append(torch.from_numpy(arr).permute(2, 0, 1))
    x = torch.stack([F.interpolate(i[None], size=(image_size, image_size))[0] for i in images])
    return (x - 0.5) / 0.5, torch.tensor(ds[label_key], dtype=torch.long)


class ImageDataModule(L.LightningDataModule):
    """Digits (offline) or an HF image dataset; ``batch_size`` is global, sharded by DP rank."""

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int = 32,
        val_fraction: float = 0.2,
        dataset_name: str | None = None,
        cache_dir: str | None = None,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        if batch_size < 1 or image_size < 8:
            raise ValueError(
                f"batch_size must be positive and image_size at least 8, got {batch_size} and "
                f"{image_size}"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.batch_size = batch_size
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.dataset_name = dataset_name
        self.cache_dir = cache_dir
        self.seed = seed
        self.splits: dict[str, Dataset] = {}
        self.num_classes = 10

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        if self.dataset_name:
            train = hf_image_tensors(self.dataset_name, "train", self.image_size, self.cache_dir)
            val = hf_image_tensors(self.dataset_name, "test", self.image_size, self.cache_dir)
            self.splits = {"train": TensorDataset(*train), "validation": TensorDataset(*val)}
            self.num_classes = int(train[1].max()) + 1
            return
        x, y = digits_tensors(self.image_size)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.splits = {
            "train": TensorDataset(x[train], y[train]),
            "validation": TensorDataset(x[val], y[val]),
        }

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        replicas, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
        if self.batch_size % replicas != 0:
            raise ValueError(
                f"data.batch_size={self.batch_size} (global) is not divisible by the {replicas} "
                f"data-parallel replicas; use a multiple of {replicas}"
            )
        sampler = DistributedSampler(
            self.splits[split],
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=True,
        )
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size // replicas,
            sampler=sampler,
            drop_last=True,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)


class ImageClassificationTask(L.LightningModule):
    """ResNet-50 classification with AdamW and warmup + cosine (the GPT task's recipe).

    ``model``: ``ResNet50`` arguments (``num_classes``, ``in_channels``); the keys shared with
    ``CausalLMTask`` (``lr``, ``weight_decay``, ``betas``, ...) mean the same here.
    """

    def __init__(
        self,
        model: dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 10,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        optimizer_impl: str = "foreach",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet50(**(model or {"num_classes": 10}))
        self.loss_fn = F.cross_entropy
        self.val_loss = MeanMetric()
        self.val_acc = MeanMetric()

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = self.loss_fn(logits, labels.to(logits.device))  # the last part's device
        # the global batch's mean (one image, one count), the same value on every rank
        count = torch.tensor(labels.shape[0], device=loss.device)
        loss = global_token_mean(loss, count, loss_replicas(self.trainer.strategy))
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        labels = labels.to(logits.device)
        loss = self.loss_fn(logits, labels)
        self.val_loss.update(loss.detach())
        self.val_acc.update((logits.argmax(-1) == labels).float().mean())
        return loss

    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", self.val_loss.compute(), prog_bar=True)
        self.log("val/acc", self.val_acc.compute())
        self.val_loss.reset()
        self.val_acc.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_warmup_cosine(self.model, self.hparams)
