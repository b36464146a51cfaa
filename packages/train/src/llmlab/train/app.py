"""The training entry point, read as a recipe: config → tokenizer → checks → strategy and
precision → data → task → callbacks → run dir → logger → trainer → fit, each step logged (rank
zero only) as it happens.

``python -m llmlab.train experiment=<name> [key=value ...]`` composes Hydra's config groups
(``conf/``) with ``experiments/<name>.yaml`` and the overrides, refuses any key that nothing
reads (:mod:`llmlab.train.compose`), checks everything that can be checked before any work
starts (model shape, parallel layout, batch split, the checkpoint to resume), and trains. A
mistake ends in one ``error:`` line and exit status 2, before any process, run dir or W&B run
exists.

Runs live in ``outputs/<experiment>/<timestamp>-<run id>/`` (resolved config, checkpoints, the
W&B run). Rank zero resolves the run dir and id once and exports them (``LLMLAB_RUN_DIR``,
``LLMLAB_RUN_ID``) before Lightning starts the other ranks, which inherit the environment —
so every rank agrees and W&B gets one run. ``ckpt_path=last`` resumes the experiment's latest
run: same directory, same W&B run id, from its last checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmlab.train.compose import (
    ConfigError,
    available_experiments,
    compose_config,
    takes_transforms,
)
from llmlab.train.task_checks import check_dpo, check_lora, check_router_loss

RUN_DIR_ENV, RUN_ID_ENV = "LLMLAB_RUN_DIR", "LLMLAB_RUN_ID"

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- checks
def validate_config(cfg: DictConfig, tokenizer_vocab: int | None = None) -> Any:
    """Everything checkable without data or processes, with messages that name the values;
    returns the :class:`~llmlab.parallel.preflight.RunConfig` the strategy was judged in (its
    ``transforms`` are the parsed ``model_transforms`` and ``compile``).

    ``train`` calls it once, after the tokenizer has filled in ``model.vocab_size: null``;
    ``tokenizer_vocab`` (else 256) stands in for it when a config is checked on its own.
    """
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
    interval = cfg.trainer.get("val_check_interval")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(
            f"trainer.val_check_interval must be a positive integer (optimizer steps between "
            f"validations), got {interval!r}"
        )
    impl = OmegaConf.select(cfg, "task.optimizer_impl", default="foreach")
    if impl not in ("default", "foreach", "fused"):
        raise ConfigError(
            f"task.optimizer_impl={impl!r} is not one of ['default', 'foreach', 'fused']"
        )
    run = run_config(cfg, model)
    check_strategy(cfg, run)
    check_router_loss(cfg, model)
    check_lora(cfg)
    check_dpo(cfg)
    from llmlab.train.tokens import data_config_problems  # vocabulary, document_mask

    if problems := data_config_problems(cfg, model, tokenizer_vocab):
        raise ConfigError("; ".join(problems))
    checkpoint_to_resume(cfg)
    return run


def run_config(cfg: DictConfig, model_config: dict[str, Any] | None = None) -> Any:
    """What the strategy needs to know about the rest of the run to judge its config: world
    size, global batch, precision, transforms (parsed here, once), clipping, and the model on
    the ``meta`` device (built only if the strategy asks)."""
    from hydra.utils import get_object

    from llmlab.parallel.preflight import RunConfig

    plugin = cfg.precision.get("plugin")
    return RunConfig(
        world_size=cfg.trainer.devices * (cfg.trainer.get("num_nodes") or 1),
        global_batch=OmegaConf.select(cfg, "data.batch_size"),
        precision=None if plugin else cfg.precision.get("trainer_precision", "32-true"),
        plugin=get_object(plugin._target_) if plugin else None,
        plugin_options=OmegaConf.to_container(plugin, resolve=True) if plugin else {},
        transforms=model_transforms(cfg),
        gradient_clip_val=OmegaConf.select(cfg, "trainer.gradient_clip_val"),
        gradient_clip_algorithm=OmegaConf.select(cfg, "trainer.gradient_clip_algorithm"),
        seq_len=OmegaConf.select(cfg, "data.block_size"),
        attention_dropout=OmegaConf.select(cfg, "model.dropout"),
        build_model=lambda: model_on_meta(cfg, model_config),
    )


def check_strategy(cfg: DictConfig, run: Any) -> None:
    """The strategy judges its own config in ``run`` (layout, precision, clipping, compile):
    ``check_config`` of its class, or data parallelism for Lightning's own strategies."""
    from hydra.utils import get_object

    from llmlab.parallel.preflight import check_strategy_config
    from llmlab.train.config_keys import HYDRA_KEYS

    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    target = node.get("_target_")
    options = {k: v for k, v in node.items() if k not in HYDRA_KEYS and k != "name"}
    try:
        strategy = get_object(target) if target else node.get("name", "auto")
        check_strategy_config(strategy, options, run)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from err


def model_on_meta(cfg: DictConfig, model_config: dict[str, Any] | None = None) -> Any:
    """The task's model, built on the ``meta`` device: its shape without memory or init cost."""
    import torch

    with torch.device("meta"):
        task = build_task(cfg, model_config)
    return getattr(task, cfg.strategy.get("model_attribute", "model"))


def checkpoint_to_resume(cfg: DictConfig, run_dir: Path | None = None) -> Path | None:
    """The checkpoint ``ckpt_path`` names (``last``: ``last.ckpt`` of ``run_dir``, by default
    the latest run), checked whole -- a damaged file is reported here, not as a traceback after
    the run started."""
    from llmlab.parallel.checkpoint import checkpoint_problem

    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        path = (run_dir or previous_run_dir(cfg)) / "checkpoints" / "last.ckpt"
        if not path.exists():
            raise ConfigError(f"ckpt_path=last: {path} does not exist (no checkpoint was written)")
    else:
        path = Path(cfg.ckpt_path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path}: {path} {problem}")
    return path


def previous_run_dir(cfg: DictConfig) -> Path:
    """The experiment's latest run, which ``ckpt_path=last`` resumes."""
    exp_dir = Path(cfg.paths.output_dir) / cfg.experiment
    latest = exp_dir / "latest"
    if not latest.is_file():
        raise ConfigError(
            f"ckpt_path=last: experiment {cfg.experiment!r} has no previous run under {exp_dir}"
        )
    return Path(latest.read_text().strip())


# --------------------------------------------------------------------------- run dir
def resolve_run(cfg: DictConfig) -> tuple[Path, str, bool]:
    """The run's directory and W&B id: inherited from rank zero, resumed, or new. Nothing is
    written here: ``new`` (True) says the directory is still to be made, by :func:`open_run`,
    once every check has passed -- so a refused run leaves no directory behind and does not
    move the experiment's ``latest`` (which ``ckpt_path=last`` resumes)."""
    if os.environ.get(RUN_DIR_ENV) and os.environ.get(RUN_ID_ENV):
        return Path(os.environ[RUN_DIR_ENV]), os.environ[RUN_ID_ENV], False
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    if node_rank > 0:
        raise ConfigError(
            f"node rank {node_rank} cannot choose the run dir on its own: set {RUN_DIR_ENV} and "
            f"{RUN_ID_ENV} to the same values on every node (see docs/multinode.md)"
        )
    if cfg.ckpt_path == "last":
        run_dir = previous_run_dir(cfg)
        return run_dir.resolve(), (run_dir / "run_id").read_text().strip(), False
    exp_dir = Path(cfg.paths.output_dir) / cfg.experiment
    run_id = secrets.token_hex(4)
    return (exp_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}").resolve(), run_id, True


def open_run(run_dir: Path, run_id: str, new: bool) -> None:
    """Make a ``new`` run's directory (its ``run_id`` file, and the experiment's ``latest``
    pointing at it), and export the dir and id for the ranks Lightning starts later."""
    if new:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_id").write_text(run_id + "\n")
        (run_dir.parent / "latest").write_text(str(run_dir) + "\n")
    os.environ[RUN_DIR_ENV], os.environ[RUN_ID_ENV] = str(run_dir), run_id


def choose_rendezvous_port() -> None:
    """Fix ``MASTER_PORT`` for the processes this run spawns, unless someone already chose it.

    Lightning would take a port from ``bind(0)``, out of the ephemeral range that every
    outgoing connection also draws from: with another run's gloo traffic on the machine (a
    sweep, a parallel test suite) the port can be gone by the time the rendezvous binds it.
    ``free_port`` picks one below that range. torchrun and multi-node launches set their own.
    """
    from llmlab.parallel.launch import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))


# --------------------------------------------------------------------------- building
def build(node: DictConfig, what: str, **app_args: Any) -> Any:
    """``node._target_(**node, **app_args)`` through Hydra, as plain Python values.

    Every key was checked against the target when the config was composed, so nothing is
    dropped here. Not recursive: an ``app_args`` value may be a config dict with a ``_target_``
    of its own (the tokenizer's, kept in the checkpoint so sampling can rebuild it), which must
    stay a dict. A constructor's refusal (``ValueError``, ``TypeError``) becomes a
    :class:`ConfigError` naming the node.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **app_args, _recursive_=False, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError | TypeError):
            raise ConfigError(f"{what} <{node._target_}>: {cause}") from cause
        raise


def build_tokenizer(cfg: DictConfig) -> Any:
    from llmlab.train.pretrained import explain_tokenizer_error

    if cfg.get("tokenizer") is None:
        return None
    try:
        return build(cfg.tokenizer, "tokenizer")
    except ConfigError as err:  # a pretrained folder's tokenizer.json: say what it is
        raise ConfigError(explain_tokenizer_error(cfg, str(err))) from err


def build_task(cfg: DictConfig, model_config: dict[str, Any] | None = None) -> Any:
    app_args: dict[str, Any] = {}
    if model_config is not None or cfg.get("model") is not None:
        app_args["model"] = model_config or OmegaConf.to_container(cfg.model, resolve=True)
    if cfg.get("tokenizer") is not None:
        app_args["tokenizer"] = OmegaConf.to_container(cfg.tokenizer, resolve=True)
    return build(cfg.task, "task", **app_args)


def build_strategy(cfg: DictConfig, transforms: Any = None) -> Any:
    """The strategy node's target, given ``transforms`` (the parsed ``model_transforms``) when
    it applies them itself (:func:`takes_transforms`); or a Lightning registry name."""
    node = cfg.strategy
    if "_target_" in node:
        extra = {"transforms": transforms} if takes_transforms(cfg) else {}
        return build(node, "strategy", **extra)
    return node.get("name", "auto")


def build_precision(cfg: DictConfig) -> tuple[str | None, list[Any]]:
    node = cfg.precision
    if node.get("plugin"):
        return None, [build(node.plugin, "precision plugin")]
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


def model_transforms(cfg: DictConfig) -> Any:
    """``model_transforms`` and ``compile`` as one ``ModelTransforms`` (validated)."""
    from llmlab.parallel.transforms import ModelTransforms

    node = cfg.get("model_transforms")
    options = OmegaConf.to_container(node, resolve=True) if node else {}
    try:
        return ModelTransforms.from_config({**options, "compile": bool(cfg.get("compile"))})
    except ValueError as err:
        raise ConfigError(f"model_transforms: {err}") from err


def hand_model_transforms(cfg: DictConfig, strategy: Any, task: Any, transforms: Any) -> None:
    """``transforms`` to whoever applies them (:func:`llmlab.parallel.parallelize.hand_transforms`:
    the strategy that took them at construction, else the replicated model); the app never
    transforms a model itself."""
    from llmlab.parallel.parallelize import hand_transforms

    try:
        hand_transforms(strategy, task, transforms, cfg.strategy.get("model_attribute", "model"))
    except ValueError as err:
        raise ConfigError(f"model_transforms: {err}") from err


def trainer_arguments(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.trainer`` as ``lightning.Trainer`` arguments.

    ``val_check_interval`` counts optimizer steps in the config and training batches in
    Lightning (with ``check_val_every_n_epoch=None``): with gradient accumulation over ``k``
    batches, validating every ``n`` steps is validating every ``n·k`` batches.
    """
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs["val_check_interval"] *= kwargs.get("accumulate_grad_batches") or 1
    return kwargs


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one experiment; returns the final callback metrics (floats) on global rank 0 and an
    empty dict on the other ranks, so a multi-process run reports its result once."""
    import lightning as L
    import torch

    from llmlab.parallel.checkpoint import AtomicCheckpointIO
    from llmlab.train.pretrained import check_tokenizer_fits, start_from_folder

    OmegaConf.set_struct(cfg, False)
    start_from_folder(cfg)  # model.init_from: the model fields from the folder's config.json
    if cfg.get("tokenizer") is not None:
        log.info("Instantiating tokenizer <%s>", cfg.tokenizer._target_)
    tokenizer = build_tokenizer(cfg)
    check_tokenizer_fits(cfg, tokenizer)
    if cfg.get("model") is not None and cfg.model.get("vocab_size", 0) is None:
        cfg.model.vocab_size = int(tokenizer.vocab_size)  # null: the tokenizer's vocabulary
    log.info("Checking the config: model, layout, batch split, data, checkpoint")
    run = validate_config(cfg, getattr(tokenizer, "vocab_size", None))
    log.info("Instantiating strategy <%s>", cfg.strategy.get("_target_", cfg.strategy.get("name")))
    strategy = build_strategy(cfg, run.transforms)
    if cfg.precision.get("plugin"):
        log.info("Instantiating precision plugin <%s>", cfg.precision.plugin._target_)
    precision, plugins = build_precision(cfg)

    # Everything that can still be refused (the data dir missing or unprepared, a damaged
    # shard, a callback's option) is built before the run dir exists or ``latest`` moves.
    run_dir, run_id, new_run = resolve_run(cfg)
    cfg.run_dir = str(run_dir)  # the checkpoint callback's dirpath; made by open_run
    L.seed_everything(cfg.seed, workers=True)
    log.info("Instantiating datamodule <%s>", cfg.data._target_)
    data = build(cfg.data, "datamodule", **({"tokenizer": tokenizer} if tokenizer else {}))
    log.info("Instantiating task <%s>", cfg.task._target_)
    task = build_task(cfg)
    callbacks = []
    for name, node in cfg.callbacks.items():
        if node is not None:
            log.info("Instantiating callback %s <%s>", name, node._target_)
            callbacks.append(build(node, f"callback {name}"))
    hand_model_transforms(cfg, strategy, task, run.transforms)

    ckpt_path = checkpoint_to_resume(cfg, run_dir)

    open_run(run_dir, run_id, new_run)
    choose_rendezvous_port()
    log.info("Run dir %s (W&B run %s)", run_dir, run_id)
    if int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.get("compile"):
        from llmlab.parallel.compile import CompileMonitor

        callbacks.append(CompileMonitor())
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [cb for cb in callbacks if not isinstance(cb, L.pytorch.callbacks.ProgressBar)]
    log.info("Instantiating logger <lightning.pytorch.loggers.WandbLogger>")
    logger = build_logger(cfg, run_dir, run_id)
    log.info("Instantiating trainer <lightning.pytorch.Trainer>")
    trainer = L.Trainer(
        **trainer_arguments(cfg),
        strategy=strategy,
        precision=precision,
        plugins=[*plugins, AtomicCheckpointIO()],
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        check_val_every_n_epoch=None,  # validate every val_check_interval steps, across epochs
        use_distributed_sampler=False,  # the data module shards by data-parallel rank itself
    )
    if trainer.is_global_zero:
        log.info("Logging hyperparameters")
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    torch.set_float32_matmul_precision("high")
    log.info("Starting training" + (f" from {ckpt_path}" if ckpt_path else ""))
    trainer.fit(task, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None)
    if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.best_model_path:
        log.info("Best checkpoint: %s", trainer.checkpoint_callback.best_model_path)
    if not trainer.is_global_zero:
        return {}
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def setup_logging() -> None:
    """The recipe's steps on stdout, as Hydra apps print them; rank zero only (the other ranks
    re-run the same command and would repeat every line)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    root = logging.getLogger("llmlab")
    if rank_zero_only.rank != 0:
        root.setLevel(logging.WARNING)
        return
    root.setLevel(logging.INFO)
    if not any(getattr(h, "_llmlab_cli", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s", "%H:%M:%S")
        )
        handler._llmlab_cli = True  # type: ignore[attr-defined]
        root.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("experiments:", ", ".join(available_experiments()))
        return 0
    from llmlab.parallel.deepspeed import DeepSpeedConfigError
    from llmlab.train.pretrained import InitFromError

    setup_logging()
    try:
        cfg = compose_config(args)
        log.info("Experiment %s: config composed, every key accepted", cfg.experiment)
        metrics = train(cfg)
    except (ConfigError, DeepSpeedConfigError, InitFromError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if metrics.get("val/loss") is not None:
        print(f"final val/loss {metrics['val/loss']:.4f}")
    return 0
