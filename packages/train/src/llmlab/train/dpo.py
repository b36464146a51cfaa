"""``task=dpo``: Direct Preference Optimization (Rafailov et al., 2023) on ``data=preference``.

For a pair (prompt x, chosen y_w, rejected y_l), with log π(y|x) the sum of the completion
tokens' log-probabilities under the trained model and log π_ref(y|x) under the frozen reference:

    r_w = β (log π(y_w|x) - log π_ref(y_w|x)),   r_l = β (log π(y_l|x) - log π_ref(y_l|x))
    loss = -log σ(r_w - r_l)                     (the "sigmoid" loss; the mean over pairs)

``r_w``, ``r_l`` are the implicit rewards, logged with their margin ``r_w - r_l`` and the
accuracy ``[r_w > r_l]`` as ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/margins``,
``dpo/accuracy`` (``val/dpo/...`` on validation): means over the *global* batch, the same on
every rank, as ``train/loss`` (the loss itself through :func:`global_token_mean` with each pair
counted once, so its gradient is one process's). The values equal TRL's ``DPOTrainer``'s on the
same log-probabilities (tests/train/test_dpo.py).

The reference (``task.reference``):

* ``adapters`` (the default with ``task.lora``): the same model with its LoRA adapters switched
  off (:func:`llmlab.models.lora.disable_lora`) -- the frozen base, no second model in memory;
* ``precomputed`` (the default without adapters): every pair's reference log-probabilities,
  computed once with the model as training starts (before the first step), kept in memory and
  in the checkpoint, so a resumed run keeps the first run's reference.

The batch is ``(inputs, targets, pair index)`` of :class:`llmlab.train.preference.
PreferenceDataModule`: chosen rows, then rejected rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric

from llmlab.parallel.loss_mean import IGNORE_INDEX, global_token_mean, loss_replicas
from llmlab.train.task import CausalLMTask

log = logging.getLogger(__name__)
REFERENCES = ("auto", "adapters", "precomputed")
METRICS = ("rewards_chosen", "rewards_rejected", "margins", "accuracy")


def sequence_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """(N,) each row's summed log-probability of its counted targets (not ``IGNORE_INDEX``),
    in fp32 at least."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    token = -F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return token.view(targets.shape).sum(dim=1)


def dpo_loss(
    chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-pair sigmoid losses, chosen rewards, rejected rewards) from the sequences'
    log-probabilities under the policy and the reference (module docstring); rewards detached."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    """Per-pair values of :data:`METRICS`."""
    return {
        "rewards_chosen": chosen_rewards,
        "rewards_rejected": rejected_rewards,
        "margins": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
    }


def config_problem(task: Mapping[str, Any], data: Mapping[str, Any]) -> str | None:
    """Why a ``task=dpo`` config cannot run (``None`` when it can): its data, its reference."""
    if not str(task.get("_target_", "")).endswith("DPOTask"):
        return None
    if not str(data.get("_target_", "")).endswith("PreferenceDataModule"):
        return (
            f"task=dpo trains on preference pairs: use data=preference (got "
            f"{str(data.get('_target_', '?')).rsplit('.', 1)[-1]})"
        )
    reference = task.get("reference", "auto")
    if reference not in REFERENCES:
        return f"task.reference={reference!r} is not one of {list(REFERENCES)}"
    if reference == "adapters" and not task.get("lora"):
        return (
            "task.reference=adapters switches LoRA adapters off, but the run has none: add "
            "+task.lora={r: 8, alpha: 16} or use task.reference=precomputed"
        )
    beta = task.get("beta", 0.1)
    if not isinstance(beta, int | float) or beta <= 0:
        return f"task.beta must be a positive number, got {beta!r}"
    return None


class DPOTask(CausalLMTask):
    """The sigmoid DPO loss on a :class:`CausalLMTask`'s model, optimizer and adapters."""

    def __init__(self, *args: Any, beta: float = 0.1, reference: str = "auto", **kwargs: Any):
        """``beta``: the KL penalty's weight β. ``reference``: ``adapters``, ``precomputed``,
        or ``auto`` (adapters when ``lora`` is set)."""
        if reference not in REFERENCES:
            raise ValueError(f"task.reference={reference!r} is not one of {list(REFERENCES)}")
        if not beta > 0:
            raise ValueError(f"task.beta must be positive, got {beta!r}")
        super().__init__(*args, **kwargs)
        if reference == "auto":
            reference = "adapters" if self.lora is not None else "precomputed"
        if reference == "adapters" and self.lora is None:
            raise ValueError("task.reference=adapters needs LoRA adapters (task.lora)")
        self.beta, self.reference = float(beta), reference
        # split -> (pairs, 2): chosen and rejected reference log-probabilities
        self.reference_logps: dict[str, Tensor] = {}
        self.val_metrics = torch.nn.ModuleDict({k: MeanMetric() for k in METRICS})

    # ----------------------------------------------------------------- log-probabilities
    def logps(self, inputs: Tensor, targets: Tensor, reference: bool = False) -> Tensor:
        """(2b,) summed completion log-probabilities of the rows, under the policy or (no
        gradient) the adapters-off reference."""
        from llmlab.models.lora import disable_lora

        if not reference:
            return sequence_logps(self.model(inputs), targets)
        with torch.no_grad(), disable_lora(self.model):
            return sequence_logps(self.model(inputs), targets)

    def reference_of(self, split: str, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        inputs, targets, index = batch
        if self.reference == "adapters":
            return self.logps(inputs, targets, reference=True).chunk(2)
        ref = self.reference_logps[split].to(inputs.device)[index]
        return ref[:, 0], ref[:, 1]

    def on_fit_start(self) -> None:
        """``precomputed``: every pair's reference log-probabilities, with the model as it is
        before the first step (kept from the checkpoint on resume)."""
        if self.reference != "precomputed" or self.reference_logps:
            return
        data = self.trainer.datamodule
        was_training = self.model.training
        self.model.eval()
        for split in ("train", "validation"):
            dataset = data.split_dataset(split)
            out = []
            with torch.no_grad():
                for start in range(0, len(dataset), data.batch_size):
                    rows = [dataset[i] for i in range(start, min(start + data.batch_size,
                                                                 len(dataset)))]  # fmt: skip
                    inputs, targets, _ = data.collate(rows)
                    logps = self.logps(inputs.to(self.device), targets.to(self.device))
                    out.append(torch.stack(logps.chunk(2), dim=1).cpu())
            self.reference_logps[split] = torch.cat(out)
        self.model.train(was_training)
        log.info("DPO reference: log-probabilities of %d train and %d validation pairs "
                 "computed once", len(self.reference_logps["train"]),
                 len(self.reference_logps["validation"]))  # fmt: skip

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_logps:
            checkpoint["dpo_reference_logps"] = self.reference_logps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_logps = dict(checkpoint.get("dpo_reference_logps", {}))

    # ----------------------------------------------------------------- steps
    def pair_losses(self, split: str, batch: tuple[Tensor, ...]) -> tuple[Tensor, dict]:
        """(per-pair losses, per-pair metrics) of this rank's pairs."""
        if len(batch) != 3:
            raise ValueError(
                "task=dpo expects (inputs, targets, pair index) batches of data=preference"
            )
        inputs, targets, _ = batch
        chosen, rejected = self.logps(inputs, targets).chunk(2)
        ref_chosen, ref_rejected = self.reference_of(split, batch)
        losses, r_chosen, r_rejected = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, self.beta
        )
        return losses, pair_metrics(r_chosen, r_rejected)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """The global batch's mean loss over its pairs (each rank's mean weighted by its pairs,
        :func:`global_token_mean`), and the metrics' global means."""
        losses, metrics = self.pair_losses("train", batch)
        pairs = torch.tensor(losses.numel(), device=losses.device)
        replicas = loss_replicas(self.trainer.strategy)
        loss = global_token_mean(losses.mean(), pairs, replicas)
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=False)
        sums = torch.stack([m.sum() for m in metrics.values()] + [pairs.to(losses.dtype)])
        sums = sums.detach().to(torch.float64)
        if replicas.size > 1:
            dist.all_reduce(sums, group=replicas.group)
        for name, total in zip(METRICS, sums[:-1]):
            self.log(f"dpo/{name}", (total / sums[-1]).float(), sync_dist=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        losses, metrics = self.pair_losses("validation", batch)
        self.val_loss.update(losses.detach().float().mean(), weight=losses.numel())
        for name, values in metrics.items():
            self.val_metrics[name].update(values.float().mean(), weight=values.numel())
        return losses.mean()

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True)  # averaged by the metric
        for name, metric in self.val_metrics.items():
            self.log(f"val/dpo/{name}", metric.compute(), sync_dist=True)
            metric.reset()
