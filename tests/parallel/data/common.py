"""A tiny deterministic task and a Trainer factory for the data-parallel strategy tests.

The Trainer is ``tests.helpers.tiny.rank_trainer`` (it runs in place inside the gloo ranks of
``run_distributed``) with clipping at 1.0 and no sanity validation. The data are sharded by hand
(``use_distributed_sampler=False``) so runs are bit-comparable.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.tiny import rank_trainer


class TinyTask(L.LightningModule):
    """An MLP regression with several layers (several buckets) and AdamW + a step LR schedule."""

    def __init__(self, width: int = 64, depth: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def shard_loader(
    replicas: int, rank: int, steps: int, batch: int = 8, width: int = 64, seed: int = 1
) -> DataLoader:
    """``steps`` batches of ``batch`` rows for this replica, cut from one global stream."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch * replicas, width, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    rows = torch.arange(x.shape[0]).view(steps, replicas, batch)[:, rank].reshape(-1)
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=batch, shuffle=False)


def make_trainer(strategy: Any, devices: int, max_steps: int, **kwargs: Any) -> L.Trainer:
    settings: dict[str, Any] = dict(gradient_clip_val=1.0, num_sanity_val_steps=0)
    return rank_trainer(strategy, devices, max_steps, **{**settings, **kwargs})


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()
