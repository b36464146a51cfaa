"""A few steps of the real ``CausalLMTask`` in a real ``lightning.Trainer``, on fixed batches.

Shared by the tests that compare a layout (strategy × precision × memory × kernels) with the
single-process run of the same settings. Each call builds its own ``Trainer``, so one
``run_distributed`` spawn can run several fits in turn (Lightning sees the process group that is
already there and does not re-launch). What a fit records, per optimizer step:

* ``losses``: the logged ``train/loss`` (what a user reads: it must be the global batch's mean
  over its counted tokens on every layout; the batches leave unequal numbers of counted tokens
  on the ranks, ``tiny_tokens(padded=True)``, so a mean of per-rank means fails);
* ``norms``: the logged ``train/grad_norm`` (the real ``TrainingTelemetry`` callback);
* ``master_norm``: an independent first-step norm of the gradients the optimizer steps on (fp32
  masters where the plugin keeps them), summed over the ranks that hold different pieces, each
  piece counted once — computed here from the parameters, not by the strategy's own helper.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tests.helpers.tiny import rank_trainer, tiny_tokens

BATCH, T = 8, 16


def make_data(vocab: int, steps: int, padded: bool = True):
    """``steps`` fixed global batches of ``BATCH`` rows, each replica reading its share."""
    return tiny_tokens(steps, val_batches=1, batch=BATCH, vocab_size=vocab, seq=T, padded=padded)


def _independent_master_norm(trainer: Any, optimizer: Any) -> float:
    """√(Σ g²) over the optimizer's gradients, each piece of the model counted once."""
    import torch.distributed as dist

    strategy = trainer.strategy
    plugin = trainer.precision_plugin
    params = [p for group in optimizer.param_groups for p in group["params"]]
    parallel = getattr(strategy, "parallel", None)
    if parallel is not None and getattr(strategy, "zero_engine", None) is not None:
        return float(strategy.global_grad_norm(optimizer))  # ZeRO: pieces of the masters
    masters = getattr(plugin, "masters", None)
    model_of = (
        {id(m): p for p, m in zip(masters.model_params, masters.masters, strict=True)}
        if masters is not None
        else {}
    )
    total = torch.zeros((), dtype=torch.float64)
    if parallel is not None:
        d, t = strategy.groups.coords.data, strategy.groups.coords.tensor
        c = strategy.groups.coords.context  # context ranks hold equal gradients, as replicas
        duplicates = {id(p) for p in parallel.duplicates}
        # an expert slice (expert parallelism) is counted on the ranks of the first expert group
        expert_group = strategy.dims.expert_coords(strategy.global_rank)[0]
        for p in params:
            owner = model_of.get(id(p), p)
            first = expert_group == 0 if hasattr(owner, "ep_slice") else d == 0 and c == 0
            if p.grad is None or id(owner) in duplicates or not first:
                continue
            if strategy.dims.tensor > 1 and getattr(owner, "tp_shard_dim", None) is None and t:
                continue  # replicated under tensor parallelism: counted on tensor rank 0
            total += p.grad.double().pow(2).sum()
        dist.all_reduce(total)
        return float(total.sqrt())
    for p in params:
        if p.grad is not None:
            total += p.grad.double().pow(2).sum()
    return float(total.sqrt())


def fit(
    strategy: Any,
    devices: int,
    model: Mapping[str, Any],
    steps: int = 3,
    plugins: Sequence[Any] = (),
    precision: str | None = None,
    transforms: Mapping[str, Any] | None = None,
    clip: float | None = None,
    lr: float = 1e-2,
    warmup_steps: int = 1,
    eps: float = 1e-8,
    callbacks: Sequence[Any] = (),
    prepare: Callable[[Any, Any], None] | None = None,
    ckpt_path: str | None = None,
    batches: int | None = None,
    padded: bool = True,
    task_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; returns losses, logged norms, the first master-gradient
    norm, and the trainer. ``transforms`` (memory options) go to ``parallelize_model`` as the
    app hands them: to the N-D strategy, or applied here to a replicated model;
    ``prepare(strategy, task)`` hands them over instead (the app's ``hand_model_transforms``);
    ``ckpt_path`` resumes from a checkpoint (``master_norm`` is None when no step runs).
    ``batches``: global batches per epoch (default ``steps``: one epoch)."""
    import lightning as L
    import torch.distributed as dist

    from llmlab.parallel.parallelize import hand_transforms
    from llmlab.train.task import CausalLMTask
    from llmlab.train.telemetry import TrainingTelemetry

    losses: list[float] = []
    norms: list[float] = []
    master: list[float] = []

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if not master:
                master.append(_independent_master_norm(trainer, optimizer))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(trainer.callback_metrics.get("train/loss", math.nan)))
            norms.append(float(trainer.callback_metrics.get("train/grad_norm", math.nan)))
            if not master:  # a strategy that steps without Lightning's optimizer hooks
                master.append(_independent_master_norm(trainer, trainer.optimizers[0]))

    if dist.is_initialized():
        os.environ["WORLD_SIZE"] = str(dist.get_world_size())  # Lightning's teardown removes it
    L.seed_everything(0)
    task = CausalLMTask(
        model=dict(model),
        lr=lr,
        warmup_steps=warmup_steps,
        max_steps=steps,
        eps=eps,
        **(task_kwargs or {}),
    )
    if prepare is not None:
        prepare(strategy, task)
    else:
        hand_transforms(strategy, task, transforms)
    trainer = rank_trainer(
        strategy,
        devices,
        steps,
        precision=precision,
        plugins=list(plugins) or None,
        gradient_clip_val=clip,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[TrainingTelemetry(peak_flops_per_device=1e12), Record(), *callbacks],
    )
    trainer.fit(
        task,
        datamodule=make_data(model["vocab_size"], batches or steps, padded),
        ckpt_path=ckpt_path,
    )
    first_master = master[0] if master else None
    return {"losses": losses, "norms": norms, "master_norm": first_master, "trainer": trainer}


def fit_config(cfg: Any, run: Any, devices: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`fit` of a composed, validated app config (``run``: ``validate_config``'s answer):
    its strategy, precision and memory options built and handed over as ``llmlab.train.app``
    builds them; ``kwargs`` go to :func:`fit`."""
    from omegaconf import OmegaConf

    from llmlab.train.app import build_precision, build_strategy, hand_model_transforms

    strategy = build_strategy(cfg, run.transforms)
    precision, plugins = build_precision(cfg)
    return fit(
        strategy,
        devices,
        OmegaConf.to_container(cfg.model, resolve=True),
        plugins=plugins,
        precision=precision,
        prepare=lambda s, task: hand_model_transforms(cfg, s, task, run.transforms),
        **kwargs,
    )


def save_at_step(step: int, path: str) -> Any:
    """A callback saving the checkpoint after the last batch of the epoch that ends at
    ``step``, a point Lightning resumes from exactly (saved after ``fit`` returns, or in
    ``on_train_epoch_end``, the resumed run replays the first batch: measured)."""
    import lightning as L

    class Save(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step:
                trainer.save_checkpoint(path)

    return Save()
