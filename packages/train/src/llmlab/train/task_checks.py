"""The app's checks of what a task asks of the rest of the config: routing losses of a mixture
of experts, LoRA adapters, DPO. Each raises ``ConfigError`` naming the values and what would
be valid, before any process starts (``llmlab.train.app.validate_config`` calls them)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmlab.train.compose import ConfigError


def check_router_loss(cfg: DictConfig, model: dict[str, Any]) -> None:
    """Routing losses (``model.router_aux_loss_coef`` / ``router_z_loss_coef`` > 0) or the
    auxiliary-loss-free bias update (``task.update_bias_rate``) with a pipeline: refused. The
    pipeline schedule computes the loss on its last stage from the logits alone, and the
    routing losses and loads pool every MoE layer, which the stages hold apart
    (``llmlab.train.routing``)."""
    coefs = {k: model.get(k) or 0 for k in ("router_aux_loss_coef", "router_z_loss_coef")}
    strategy = OmegaConf.to_container(cfg.strategy, resolve=True)
    stages = strategy.get("pipeline") or strategy.get("stages") or 1
    coefs["task.update_bias_rate"] = OmegaConf.select(cfg, "task.update_bias_rate") or 0
    for name, value in coefs.items():
        if value and model.get("num_experts") and stages > 1:
            where = name if name.startswith("task.") else f"model.{name}"
            raise ConfigError(
                f"{where}={value} with a pipeline of {stages} stages is refused: the "
                "schedule computes the loss on its last stage from the logits alone, and the "
                "routing losses and loads pool the MoE layers of every stage; not implemented. "
                f"Set {where}=0 or use a layout without pipeline stages"
            )


def check_lora(cfg: DictConfig) -> None:
    """``task.lora``'s fields, and a layout adapters are wired through
    (:func:`llmlab.train.adapters.strategy_problem`)."""
    from llmlab.train.adapters import lora_config, strategy_problem

    spec = OmegaConf.select(cfg, "task.lora")
    if spec is None:
        return
    try:
        lora = lora_config(OmegaConf.to_container(spec, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    if problem := strategy_problem(OmegaConf.to_container(cfg.strategy, resolve=True), lora):
        raise ConfigError(problem)


def check_dpo(cfg: DictConfig) -> None:
    """``task=dpo``: preference data, a reference it can have, and a strategy that leaves the
    step to the task (one process or Lightning's DDP)."""
    from llmlab.train.adapters import PLAIN_STRATEGIES
    from llmlab.train.dpo import config_problem

    task, data, strategy = (
        OmegaConf.to_container(cfg[k], resolve=False) for k in ("task", "data", "strategy")
    )
    if problem := config_problem(task, data):
        raise ConfigError(problem)
    which = strategy.get("_target_") or strategy.get("name") or "auto"
    if str(task.get("_target_", "")).endswith("DPOTask") and which not in PLAIN_STRATEGIES:
        raise ConfigError(
            f"task=dpo with strategy {which}: DPO runs under one process or Lightning's DDP "
            "(strategy=auto or strategy=ddp) for now; the other layouts own the step"
        )
