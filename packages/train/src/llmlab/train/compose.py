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
        hint = _group_key_hint(str(err), overrides, experiment)
        raise ConfigError(hint or f"bad override in {overrides}: {err}") from err
    problems = unaccepted_keys(cfg, app_arguments(cfg), CONF_DIR)
    if problems:
        raise ConfigError(f"experiment {experiment}: " + " | ".join(problems))
    return cfg


def _group_key_hint(error: str, overrides: list[str], experiment: str) -> str | None:
    """For ``group.key=value`` where the chosen option of config group ``group`` has no
    ``key`` but other options do (``strategy.tensor=3`` with the default ``strategy=auto``):
    which options have it, and the spelling that works (``strategy=nd strategy.tensor=3``).
    Hydra's own advice, ``+strategy.tensor=3``, appends a key that the chosen option's target
    does not take, which is then refused. ``None`` for any other error: Hydra's message stands
    (a ``+trainer.<kwarg>`` can be right, the Trainer taking more than its YAML lists)."""
    import re

    found = re.search(r"Could not override '([^']+)'", error)
    if found is None:
        return None
    key = found.group(1)
    group, _, rest = key.partition(".")
    options = sorted((CONF_DIR / group).glob("*.yaml")) if rest else []
    having = [p.stem for p in options if OmegaConf.select(OmegaConf.load(p), rest) is not None]
    if not having:
        return None
    having.sort(key=lambda name: name != "nd")  # the one strategy that runs every layout first
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "...")
    rest_overrides = [o for o in overrides if o.split("=", 1)[0] != key]
    chosen = _chosen_option(group, rest_overrides, experiment)
    return (
        f"{key}={value}: the chosen {group} ({group}={chosen}) has no '{rest}' setting; "
        f"{', '.join(f'{group}={h}' for h in having)} {'has' if len(having) == 1 else 'have'} "
        f"it: choose one first, e.g. `{group}={having[0]} {key}={value}` (not +{key}: a key the "
        f"chosen {group} does not take is refused)"
    )


def _chosen_option(group: str, overrides: list[str], experiment: str) -> str:
    """The option of config group ``group`` that the experiment and ``overrides`` select
    (Hydra's ``runtime.choices``), or ``?`` if they do not compose either."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    search = f"hydra.searchpath=[file://{experiments_dir().parent}]"
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[search, f"+experiments={experiment}", f"experiment={experiment}",
                           *overrides],
                return_hydra_config=True,
            )  # fmt: skip
    except HydraException:
        return "?"
    return str(cfg.hydra.runtime.choices.get(group, "?"))


def app_arguments(cfg: DictConfig) -> dict[str, tuple[str, ...]]:
    """The keywords ``train`` passes to a node's target on top of the node's own keys."""
    tokenizer = ("tokenizer",) if cfg.get("tokenizer") is not None else ()
    model = ("model",) if cfg.get("model") is not None else ()
    strategy = ("transforms",) if takes_transforms(cfg) else ()
    return {"data": tokenizer, "task": model + tokenizer, "strategy": strategy}


def _register_resolvers() -> None:
    """``${loss_scaler:<name>}`` in ``conf/precision/*.yaml``: a default of the fp16 loss scaler,
    read from ``llmlab.parallel.precision.scaler.DEFAULTS`` so no YAML repeats the numbers.
    ``${llmlab_example:<path>}``: a file of the examples that ship with ``llmlab.train``
    (``examples/``, e.g. the chat data and tokenizer), wherever it is installed."""
    if not OmegaConf.has_resolver("loss_scaler"):
        OmegaConf.register_new_resolver("loss_scaler", _loss_scaler_default)
    if not OmegaConf.has_resolver("llmlab_example"):
        OmegaConf.register_new_resolver("llmlab_example", _example_path)


def _example_path(relative: str) -> str:
    path = Path(__file__).resolve().parent / "examples" / relative
    if not path.exists():
        raise KeyError(f"${{llmlab_example:{relative}}}: {path} does not exist")
    return str(path)


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
