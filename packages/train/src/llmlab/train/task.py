"""``CausalLMTask``: next-token training of any ``llmlab.models`` language model (GPT, Llama) as a
LightningModule; the model comes from its config dict through ``llmlab.models.build_model``.

The task owns what is the same for every strategy: the loss, the metric names, AdamW with
decoupled weight decay (no decay on biases, norms and embeddings) and a warmup + cosine schedule
stepped per optimizer step. Strategies may swap ``task.model`` (sharded, split into stages) and
``task.loss_fn`` (vocab-parallel cross-entropy) without touching this file.

A model with ``init_from`` (a Hugging Face-format folder) is built on the ``meta`` device and its
weights are read once the layout is known: a strategy that applies a layout takes them
(``take_pretrained_weights``) and reads each rank's part; otherwise ``configure_model``, which
Lightning calls before any strategy's setup, reads them whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from llmlab.models.hf import build_model_unloaded
from llmlab.parallel.loss_mean import (
    IGNORE_INDEX,
    counted_tokens,
    global_token_mean,
    loss_replicas,
)
from llmlab.train.adapters import adapters_only, adapters_only_state, add_adapters, lora_config
from llmlab.train.routing import BiasUpdate, router_loss


def causal_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the counted targets (not ``IGNORE_INDEX``), in nats,
    in fp32 at least (fp64 logits keep their precision); 0, not NaN, when none counts (a rank
    whose share of the batch is all padding still joins the global mean)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / counted_tokens(targets).clamp(min=1)


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_lr_ratio`` at max_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


DECAYED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only the weights of Linear and conv layers; biases, norms and embeddings are not."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))  # tied weights appear twice; count them once
            (decay if isinstance(module, DECAYED_LAYERS) and name == "weight" else no_decay).append(
                p
            )
    # The LM head's weight is the tied embedding when tie_embeddings: nn.Embedding saw it first.
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# How torch.optim.AdamW runs its update (the maths is the same):
#   default: torch's own choice (a per-parameter Python loop on CPU, foreach on CUDA);
#   foreach: one multi-tensor kernel per operation across all parameters;
#   fused:   one fused kernel per parameter group (CPU and CUDA).
# Measured on the default experiment (benchmarks/train.py, docs/performance.md): foreach is
# bit-identical to the loop and faster; fused is faster still but rounds differently (about
# 1e-6 off the loop's parameters after 10 steps), so the default is the fastest exact one:
# foreach.
OPTIMIZER_IMPLS = {
    "default": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def adamw(params: Any, impl: str = "foreach", **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the implementation ``impl`` (see ``OPTIMIZER_IMPLS``)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"task.optimizer_impl={impl!r} is not one of {list(OPTIMIZER_IMPLS)}")
    return torch.optim.AdamW(params, **kwargs, **OPTIMIZER_IMPLS[impl])


def adamw_warmup_cosine(model: nn.Module, hp: Any) -> dict[str, Any]:
    """AdamW on ``param_groups`` and a per-step warmup + cosine schedule, from a task's
    hyper-parameters (``lr, weight_decay, betas, eps, warmup_steps, max_steps, min_lr_ratio``,
    ``optimizer_impl``)."""
    optimizer = adamw(
        param_groups(model, hp.weight_decay),
        impl=hp.get("optimizer_impl", "foreach"),
        lr=hp.lr,
        betas=tuple(hp.betas),
        eps=hp.eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine(step, hp.warmup_steps, hp.max_steps, hp.min_lr_ratio),
    )
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
    }


class CausalLMTask(L.LightningModule):
    def __init__(
        self,
        model: dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        tokenizer: dict[str, Any] | None = None,
        optimizer_impl: str = "foreach",
        lora: dict[str, Any] | None = None,
        update_bias_rate: float = 0.0,
    ) -> None:
        """``model``: the model's config fields plus ``arch`` (``"gpt"`` when absent, ``"llama"``),
        kept in the checkpoint's hyper-parameters so ``llmlab.train.sample`` rebuilds the same
        class. ``tokenizer``: the tokenizer's config, kept there for the same reason.
        ``optimizer_impl``: ``default``, ``foreach`` or ``fused`` (see ``OPTIMIZER_IMPLS``).
        ``lora``: low-rank adapters on the loaded model, the rest frozen
        (:mod:`llmlab.train.adapters`; fields of ``llmlab.models.lora.LoRAConfig``).
        ``update_bias_rate``: γ of DeepSeek-V3's auxiliary-loss-free balancing, applied after
        each optimizer step (0: off; :mod:`llmlab.train.routing`)."""
        if optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"task.optimizer_impl={optimizer_impl!r} is not one of {list(OPTIMIZER_IMPLS)}"
            )
        adapters = lora_config(lora)  # checked before anything is built
        super().__init__()
        self.save_hyperparameters()
        self.lora = adapters
        self.model: nn.Module
        self.model, self._pretrained = build_model_unloaded(model)  # meta with init_from
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] = causal_lm_loss
        self.val_loss = MeanMetric()  # weighted by counted tokens, over batches and ranks
        self.bias_update = BiasUpdate(update_bias_rate) if update_bias_rate else None
        self._bias_step = 0  # the optimizer step the bias last moved after (set at the start)
        if adapters is not None and model.get("init_from"):  # the base is the folder: the
            self.register_state_dict_post_hook(adapters_only_state)  # state is the adapters

    def take_pretrained_weights(self) -> Any:
        """The init_from weights the meta model still waits for (``None`` once taken): the
        caller reads them (``llmlab.parallel.contracts.HoldsPretrainedWeights``)."""
        weights, self._pretrained = self._pretrained, None
        return weights

    def configure_model(self) -> None:
        """The init_from weights, whole, when no strategy took them to read its ranks' parts."""
        from llmlab.parallel.checkpoint.pretrained import load_pretrained, log_weights_read

        weights = self.take_pretrained_weights()
        if weights is not None:
            log_weights_read(load_pretrained(self.model, weights), "whole model")
        if self.lora is not None:  # on the loaded weights, under their own names
            add_adapters(self.model, self.lora)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """An adapters-only checkpoint loads over the base this task read from its folder: every
        adapter must be there (checked here), the base is not asked for (loaded non-strictly,
        in any layout: one process, DDP, or the N-D strategy's slices)."""
        state = checkpoint.get("state_dict")
        if self.lora is not None and state is not None and adapters_only(state, self.model):
            self.strict_loading = False

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def batch_loss(self, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """(mean loss, counted targets) of this rank's ``(inputs, targets)``, or of ``(inputs,
        targets, document_ids)`` from a data module with ``document_mask=true``: attention then
        stays inside each packed document."""
        inputs, targets, *rest = batch
        docs = {"document_ids": rest[0]} if rest else {}
        return self.loss_fn(self.model(inputs, **docs), targets), counted_tokens(targets)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """The global batch's mean over its counted tokens, the same value on every rank of
        every layout (:mod:`llmlab.parallel.loss_mean`), so ``train/loss`` is what one process
        logs; its gradient is this rank's share. A mixture-of-experts model adds its weighted
        routing losses of the same global batch to what is differentiated, logged apart as
        ``train/aux_loss`` (and ``train/z_loss``; :mod:`llmlab.train.routing`)."""
        local, count = self.batch_loss(batch)
        replicas = loss_replicas(self.trainer.strategy)
        loss = global_token_mean(local, count, replicas)
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=False)
        if self.bias_update is not None:
            self.bias_update.add(self.model)
        routing = router_loss(self.model, replicas)  # None without routers or coefficients
        if routing is None:
            return loss
        # A mixture of experts: its routing losses over the same global batch join the loss
        # that is differentiated, not the one logged (llmlab.train.routing).
        self.log("train/aux_loss", routing.aux, sync_dist=False)
        if routing.z is not None:
            self.log("train/z_loss", routing.z, sync_dist=False)
        return loss + routing.total

    def on_train_start(self) -> None:
        self._bias_step = self.trainer.global_step  # a resumed run starts mid-way

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step (not after a micro-batch that only accumulated), the
        auxiliary-loss-free bias update from the step's loads over every loss replica."""
        step = self.trainer.global_step
        if self.bias_update is not None and step != self._bias_step:
            self._bias_step = step
            self.bias_update.apply(self.model, loss_replicas(self.trainer.strategy))

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        loss, count = self.batch_loss(batch)
        self.val_loss.update(loss.detach().float(), weight=count.float())
        return loss

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss.compute()
        self.val_loss.reset()
        # Already averaged over ranks by the metric; sync_dist only silences Lightning's check.
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(val_loss), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_warmup_cosine(self.model, self.hparams)
