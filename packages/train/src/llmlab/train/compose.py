"""One config from Hydra's groups, an experiment file and the overrides, every key accounted for.

``conf/train.yaml``'s groups (``conf/``) + ``experiments/<name>.yaml`` (only the keys that differ)
+ ``key=value`` overrides make one ``DictConfig``; any key that nothing reads is refused by name
(:mod:`llmlab.train.config_keys`), with what the app itself passes to each target taken into
account (:func:`app_arguments`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmlab.train.config_keys import unaccepted_keys

CONF_DIR = Path(__file__).resolve().parent / "conf"


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
    """Compose ``conf/train.yaml`` + ``experiment=<name>`` + Hydra overrides into one config,
    refusing every key that nothing reads (:mod:`llmlab.train.config_keys`)."""
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
    _register_resolvers()
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
    problems = unaccepted_keys(cfg, app_arguments(cfg), CONF_DIR)
    if problems:
        raise ConfigError(f"experiment {experiment}: " + " | ".join(problems))
    return cfg


def app_arguments(cfg: DictConfig) -> dict[str, tuple[str, ...]]:
    """The keywords ``train`` passes to a node's target on top of the node's own keys."""
    tokenizer = ("tokenizer",) if cfg.get("tokenizer") is not None else ()
    model = ("model",) if cfg.get("model") is not None else ()
    strategy = ("transforms",) if takes_transforms(cfg) else ()
    return {"data": tokenizer, "task": model + tokenizer, "strategy": strategy}


def _register_resolvers() -> None:
    """``${loss_scaler:<name>}`` in ``conf/precision/*.yaml``: a default of the fp16 loss scaler,
    read from ``llmlab.parallel.precision.scaler.DEFAULTS`` so no YAML repeats the numbers."""
    if not OmegaConf.has_resolver("loss_scaler"):
        OmegaConf.register_new_resolver("loss_scaler", _loss_scaler_default)


def _loss_scaler_default(name: str) -> Any:
    from llmlab.parallel.precision.scaler import DEFAULTS

    if name not in DEFAULTS:
        raise KeyError(f"${{loss_scaler:{name}}}: no such default; valid: {sorted(DEFAULTS)}")
    return DEFAULTS[name]


def takes_transforms(cfg: DictConfig) -> bool:
    """Whether the strategy's target takes ``transforms`` (and applies them with its layout)."""
    from hydra.utils import get_object

    from llmlab.train.config_keys import accepted_keywords

    node = cfg.get("strategy")
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    try:
        accepted = accepted_keywords(get_object(target)) if target else None
    except Exception:  # an import error: reported by name when the config is composed
        return False
    return "transforms" in (accepted or {})
