"""The training entry point, read as a recipe: config → checks → run dir → data → model →
callbacks → logger → trainer → fit.

``python -m llmlab.train experiment=<name> [key=value ...]`` composes Hydra's config groups
(``conf/``) with ``experiments/<name>.yaml`` and the overrides, checks everything that can be
checked before any work starts, and trains.

Runs live in ``outputs/<experiment>/<timestamp>-<run id>/`` (resolved config, checkpoints, the
W&B run). Rank zero resolves the run dir and id once and exports them (``LLMLAB_RUN_DIR``,
``LLMLAB_RUN_ID``) before Lightning starts the other ranks, which inherit the environment —
so every rank agrees and W&B gets one run. ``ckpt_path=last`` resumes the experiment's latest
run: same directory, same W&B run id, from its last checkpoint.
"""

from __future__ import annotations

import inspect
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent / "conf"
RUN_DIR_ENV, RUN_ID_ENV = "LLMLAB_RUN_DIR", "LLMLAB_RUN_ID"


class ConfigError(ValueError):
    """A bad experiment or override, reported before any work starts."""


# --------------------------------------------------------------------------- composing
def experiments_dir() -> Path:
    """``$LLMLAB_EXPERIMENTS_DIR``, else ``./experiments``, else the repo's ``experiments/``."""
    env = os.environ.get("LLMLAB_EXPERIMENTS_DIR")
    if env:
        return Path(env).resolve()
    here = Path.cwd() / "experiments"
    if here.is_dir():
        return here.resolve()
    return Path(__file__).resolve().parents[5] / "experiments"


def available_experiments() -> list[str]:
    return sorted(p.stem for p in experiments_dir().glob("*.yaml"))


def compose_config(args: list[str]) -> DictConfig:
    """Compose ``conf/train.yaml`` + ``experiment=<name>`` + Hydra overrides into one config."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    experiment = "gpt_shakespeare"
    overrides = []
    for arg in args:
        if arg.startswith("experiment="):
            experiment = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    known = available_experiments()
    if experiment not in known:
        raise ConfigError(
            f"unknown experiment {experiment!r} (no {experiments_dir()}/{experiment}.yaml); "
            f"available: {', '.join(known)}"
        )
    search = f"hydra.searchpath=[file://{experiments_dir().parent}]"
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    search,
                    f"+experiments={experiment}",
                    f"experiment={experiment}",
                    *overrides,
                ],
            )
    except HydraException as err:
        raise ConfigError(f"bad override in {overrides}: {err}") from err
    return cfg


# --------------------------------------------------------------------------- checks
MASTER_WEIGHT_PLUGINS = ("FP16MasterPrecision", "BF16MasterPrecision")


def validate_config(cfg: DictConfig, tokenizer_vocab: int | None = None) -> None:
    """Everything checkable without data or processes, with messages that name the values."""
    from llmlab.models import model_config

    model = OmegaConf.to_container(cfg.model, resolve=True)
    if "arch" in model or "n_layer" in model:  # a language model of llmlab.models' registry
        if model.get("vocab_size") is None:
            model["vocab_size"] = tokenizer_vocab or 256
        try:
            model_config(model)
        except TypeError as err:
            raise ConfigError(f"bad model config: {err}") from err
        except ValueError as err:  # "LlamaConfig.n_head=5 ..." -> "model.n_head=5 ..."
            raise ConfigError(re.sub(r"\b[A-Z]\w*Config\.", "model.", str(err))) from err
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"trainer.devices must be a positive integer here, got {devices!r}")
    max_steps = cfg.trainer.max_steps
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ConfigError(f"trainer.max_steps must be a positive integer, got {max_steps!r}")
    strategy = str(OmegaConf.select(cfg, "strategy._target_", default=""))
    plugin = str(OmegaConf.select(cfg, "precision.plugin._target_", default=""))
    if strategy.endswith("ParameterServerStrategy") and plugin.endswith(MASTER_WEIGHT_PLUGINS):
        raise ConfigError(
            f"precision plugin {plugin.rsplit('.', 1)[-1]} cannot run on a parameter server (the "
            "servers step the optimizer, the plugin's fp32 masters never would); valid there: "
            "precision=fp32, bf16_mixed or fp8"
        )
    if cfg.get("compile"):
        from llmlab.parallel.compile import compile_refusal

        refusal = compile_refusal(strategy or str(OmegaConf.select(cfg, "strategy.name")))
        if refusal:
            raise ConfigError(refusal)
    impl = OmegaConf.select(cfg, "task.optimizer_impl", default="foreach")
    if impl not in ("default", "foreach", "fused"):
        raise ConfigError(
            f"task.optimizer_impl={impl!r} is not one of ['default', 'foreach', 'fused']"
        )
    if cfg.ckpt_path not in (None, "last") and not Path(cfg.ckpt_path).is_file():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path!r} is not a file (or use ckpt_path=last)")


# --------------------------------------------------------------------------- run dir
def resolve_run(cfg: DictConfig) -> tuple[Path, str]:
    """The run's directory and W&B id: inherited from rank zero, resumed, or new."""
    if os.environ.get(RUN_DIR_ENV) and os.environ.get(RUN_ID_ENV):
        return Path(os.environ[RUN_DIR_ENV]), os.environ[RUN_ID_ENV]
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    if node_rank > 0:
        raise ConfigError(
            f"node rank {node_rank} cannot choose the run dir on its own: set {RUN_DIR_ENV} and "
            f"{RUN_ID_ENV} to the same values on every node (see docs/multinode.md)"
        )
    exp_dir = Path(cfg.paths.output_dir) / cfg.experiment
    latest = exp_dir / "latest"
    if cfg.ckpt_path == "last":
        if not latest.is_file():
            raise ConfigError(
                f"ckpt_path=last: experiment {cfg.experiment!r} has no previous run under {exp_dir}"
            )
        run_dir = Path(latest.read_text().strip())
        run_id = (run_dir / "run_id").read_text().strip()
    else:
        run_id = secrets.token_hex(4)
        run_dir = exp_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_id").write_text(run_id + "\n")
        latest.write_text(str(run_dir.resolve()) + "\n")
    os.environ[RUN_DIR_ENV], os.environ[RUN_ID_ENV] = str(run_dir.resolve()), run_id
    return run_dir.resolve(), run_id


def last_checkpoint(run_dir: Path) -> Path:
    path = run_dir / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(f"ckpt_path=last: {path} does not exist (no checkpoint was written)")
    return path


# --------------------------------------------------------------------------- building
def _instantiate(node: DictConfig, **extra: Any) -> Any:
    """Build ``node._target_(**node, **extra)``, passing only the ``extra`` its target accepts.

    Called directly rather than through Hydra's recursive ``instantiate``: ``extra`` may hold
    plain config dicts with a ``_target_`` of their own (the tokenizer's config, kept in the
    checkpoint so sampling can rebuild it), which must stay dicts.
    """
    from hydra.utils import get_method

    target = get_method(node._target_)
    params = inspect.signature(target).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in extra.items() if takes_all or k in params}
    kwargs = OmegaConf.to_container(node, resolve=True)
    kwargs.pop("_target_")
    return target(**kwargs, **accepted)


def build_strategy(cfg: DictConfig) -> Any:
    node = cfg.strategy
    if "_target_" in node:
        return _instantiate(node)
    return node.get("name", "auto")


def build_precision(cfg: DictConfig) -> tuple[str | None, list[Any]]:
    node = cfg.precision
    if node.get("plugin"):
        return None, [_instantiate(node.plugin)]
    return node.get("trainer_precision", "32-true"), []


def build_logger(cfg: DictConfig, run_dir: Path, run_id: str) -> Any:
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_MODE", cfg.logger.mode)
    logger = WandbLogger(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        group=cfg.experiment,
        tags=list(cfg.tags),
        id=run_id,
        name=f"{cfg.experiment}-{run_id}",
        save_dir=str(run_dir),
        resume="allow",
        mode=cfg.logger.mode,
    )
    return logger


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one experiment; returns the final callback metrics (floats) on global rank 0 and an
    empty dict on the other ranks, so a multi-process run reports its result once."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    validate_config(cfg)
    run_dir, run_id = resolve_run(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    ckpt_path = str(last_checkpoint(run_dir)) if cfg.ckpt_path == "last" else cfg.ckpt_path
    L.seed_everything(cfg.seed, workers=True)

    tokenizer = instantiate(cfg.tokenizer, _convert_="all") if "tokenizer" in cfg else None
    if "vocab_size" in cfg.model and cfg.model.vocab_size is None:
        cfg.model.vocab_size = int(tokenizer.vocab_size)
    validate_config(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    data = _instantiate(cfg.data, tokenizer=tokenizer)
    task = _instantiate(
        cfg.task,
        model=OmegaConf.to_container(cfg.model, resolve=True),
        tokenizer=OmegaConf.to_container(cfg.tokenizer, resolve=True) if tokenizer else None,
    )
    if cfg.get("model_transforms"):  # memory reuse, applied from outside the model
        from llmlab.parallel.memory import apply_memory_options

        apply_memory_options(task.model, **OmegaConf.to_container(cfg.model_transforms))
    callbacks = [_instantiate(node) for node in cfg.callbacks.values() if node is not None]
    # ---- compile=true: the last model transform before the strategy wraps the model (perf
    # branch; to move into the N-D strategy's model-transform function).
    if cfg.get("compile"):
        from llmlab.parallel.compile import CompileMonitor, compile_blocks, compile_loss

        compile_blocks(task.model)
        task.loss_fn = compile_loss(task.loss_fn)
        callbacks.append(CompileMonitor())
    # ---- end compile
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [cb for cb in callbacks if not isinstance(cb, L.pytorch.callbacks.ProgressBar)]
    logger = build_logger(cfg, run_dir, run_id)
    precision, plugins = build_precision(cfg)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=build_strategy(cfg),
        precision=precision,
        plugins=plugins or None,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        check_val_every_n_epoch=None,  # validate every val_check_interval steps, across epochs
        use_distributed_sampler=False,  # the data module shards by data-parallel rank itself
    )
    if trainer.is_global_zero:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    torch.set_float32_matmul_precision("high")
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    if not trainer.is_global_zero:
        return {}
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("experiments:", ", ".join(available_experiments()))
        return 0
    from llmlab.parallel.deepspeed import DeepSpeedConfigError

    try:
        cfg = compose_config(args)
        metrics = train(cfg)
    except (ConfigError, DeepSpeedConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if metrics.get("val/loss") is not None:
        print(f"final val/loss {metrics['val/loss']:.4f}")
    return 0
