"""Every key of a composed config must be read by something; any other key is refused by name.

Hydra's struct mode refuses an unknown *override* (``model.n_haed=5``), but keys that config
groups and experiment files bring in compose freely: a typo there (``strategy: {tensr: 2}``)
reached its target as an unexpected keyword only once processes had started, or vanished into a
``**kwargs`` and changed nothing. :func:`unaccepted_keys` compares each node with its reader
before any work starts:

* a node with ``_target_``: the target's keyword parameters, following ``**kwargs`` up the class
  hierarchy (``super().__init__(**kwargs)``) and into the callable a known class hands them to;
* ``trainer``: ``lightning.Trainer``'s parameters, less those the app sets itself;
* the top level and ``paths``: the keys ``conf/train.yaml`` declares (its groups included);
* ``precision``, ``logger`` and a ``strategy`` without ``_target_``: the keys the app reads.

``model`` is checked where it is built (the task chooses the model class), ``model_transforms``
by the function that applies it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_", "_args_"})

# Classes whose own ``**kwargs`` is not passed up the hierarchy but to another callable; the
# names that callable receives from the class itself are excluded.
FORWARDED_KWARGS: dict[str, tuple[str, frozenset[str]]] = {
    # DDPStrategy keeps **kwargs for DistributedDataParallel(module, device_ids, **kwargs).
    "lightning.pytorch.strategies.ddp.DDPStrategy": (
        "torch.nn.parallel.DistributedDataParallel",
        frozenset({"module", "device_ids"}),
    ),
}

# Nodes without a ``_target_``: the keys the app reads from them.
APP_READS: dict[str, frozenset[str]] = {
    "precision": frozenset({"trainer_precision", "plugin"}),
    "logger": frozenset({"project", "entity", "mode"}),
    "strategy": frozenset({"name"}),  # a registered strategy name; a _target_ is built instead
}

TRAINER = "lightning.pytorch.Trainer"
# Trainer arguments that come from their own config groups or from the app.
TRAINER_SET_BY_APP = {
    "strategy": "the strategy group (strategy=<name>)",
    "precision": "the precision group (precision=<name>)",
    "plugins": "the precision group",
    "logger": "the logger group",
    "callbacks": "the callbacks group",
    "default_root_dir": "the run dir",
    "check_val_every_n_epoch": "the app (validation counts steps across epochs)",
    "use_distributed_sampler": "the app (the data modules shard by data-parallel rank)",
}


def accepted_keywords(target: Callable[..., Any]) -> dict[str, str] | None:
    """The keyword arguments ``target`` accepts, each mapped to where it is declared; ``None``
    when a ``**kwargs`` leads somewhere that cannot be followed (anything is accepted).

    A class's ``**kwargs`` is taken to go to the next ``__init__`` up its MRO, as
    ``super().__init__(**kwargs)`` does, unless :data:`FORWARDED_KWARGS` says where it goes; a
    ``**kwargs`` still open when only ``object`` is left was kept for something else.
    """
    from hydra.utils import get_object

    if not inspect.isclass(target):
        own = _named_parameters(target, skip_first=False, owner=_name(target))
        return None if _takes_var_keyword(target) else own
    if target.__init__ is object.__init__:
        return {}
    accepted: dict[str, str] = {}  # subclass first: the names a user most likely means
    for klass in target.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass is object:  # reached only through a **kwargs that no base takes: kept for
            return None  # something unknown
        for name, owner in _named_parameters(init, True, klass.__name__).items():
            accepted.setdefault(name, owner)
        if not _takes_var_keyword(init):
            return accepted  # no **kwargs: the hierarchy ends here
        forward = FORWARDED_KWARGS.get(f"{klass.__module__}.{klass.__qualname__}")
        if forward is not None:
            receiver, excluded = forward
            more = accepted_keywords(get_object(receiver))
            if more is None:
                return None
            for name, owner in more.items():
                if name not in excluded:
                    accepted.setdefault(name, owner)
            return accepted
    return accepted


def _takes_var_keyword(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _named_parameters(fn: Callable[..., Any], skip_first: bool, owner: str) -> dict[str, str]:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_first else 0 :]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: owner for p in params if p.kind in kinds}


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def describe(accepted: Mapping[str, str]) -> str:
    """``a, b (Owner); c, d (Base)``: the accepted names grouped by where they are declared."""
    groups: dict[str, list[str]] = {}
    for name, owner in accepted.items():
        groups.setdefault(owner, []).append(name)
    return "; ".join(f"{', '.join(names)} ({owner})" for owner, names in groups.items())


def _refusal(path: str, key: str, reader: str, accepted: Mapping[str, str]) -> str:
    close = difflib.get_close_matches(key, list(accepted), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{path}.{key}: {reader} takes no {key!r}{hint}; it takes: {describe(accepted)}"


def unaccepted_keys(
    cfg: DictConfig, app_arguments: Mapping[str, tuple[str, ...]], conf_dir: Path
) -> list[str]:
    """One message per key that nothing reads, or that its target does not take.

    ``app_arguments``: the keywords the app passes to a node's target on top of its config
    (``{"data": ("tokenizer",)}``); the target must take them and the config must not set them.
    """
    problems: list[str] = []
    declared = OmegaConf.load(conf_dir / "train.yaml")
    groups = [next(iter(d)) if isinstance(d, Mapping) else d for d in declared.get("defaults", [])]
    top = {str(k) for k in declared if k != "defaults"} | {g for g in groups if g != "_self_"}
    problems += _unknown("", cfg, {k: "conf/train.yaml" for k in sorted(top)}, "the config")
    if isinstance(cfg.get("paths"), DictConfig):
        paths = {str(k): "conf/train.yaml" for k in declared.get("paths", {})}
        problems += _unknown("paths", cfg.paths, paths, "paths")
    if isinstance(cfg.get("trainer"), DictConfig):
        problems += _trainer_problems(cfg.trainer)
    for name, reads in APP_READS.items():
        node = cfg.get(name)
        if isinstance(node, DictConfig) and "_target_" not in node:
            app_reads = dict.fromkeys(sorted(reads), "llmlab.train.app")
            problems += _unknown(name, node, app_reads, "the app")
    targets = [(name, cfg.get(name)) for name in ("tokenizer", "data", "task", "strategy")]
    precision = cfg.get("precision")
    if isinstance(precision, DictConfig) and precision.get("plugin") is not None:
        targets.append(("precision.plugin", precision.plugin))
    if isinstance(cfg.get("callbacks"), DictConfig):
        targets += [(f"callbacks.{k}", v) for k, v in cfg.callbacks.items() if v is not None]
    for path, node in targets:
        if not isinstance(node, DictConfig):
            continue
        if "_target_" not in node:
            if path not in APP_READS:
                problems.append(f"{path} has no _target_ (the class or function that builds it)")
            continue
        problems += _target_problems(path, node, app_arguments.get(path, ()))
    return problems


def _unknown(path: str, node: DictConfig, accepted: Mapping[str, str], reader: str) -> list[str]:
    return [
        _refusal(path, str(k), reader, accepted).lstrip(".") for k in node if str(k) not in accepted
    ]


def _trainer_problems(node: DictConfig) -> list[str]:
    from hydra.utils import get_object

    accepted = {k: v for k, v in accepted_keywords(get_object(TRAINER)).items()}
    problems = []
    for key in node:
        key = str(key)
        if key in TRAINER_SET_BY_APP:
            problems.append(f"trainer.{key} is set by {TRAINER_SET_BY_APP[key]}, not trainer.*")
        elif key not in accepted:
            allowed = {k: v for k, v in accepted.items() if k not in TRAINER_SET_BY_APP}
            problems.append(_refusal("trainer", key, TRAINER, allowed))
    return problems


def _target_problems(path: str, node: DictConfig, app_args: tuple[str, ...]) -> list[str]:
    from hydra.utils import get_object

    target_name = str(node._target_)
    try:
        target = get_object(target_name)
    except Exception as err:  # ImportError, AttributeError: Hydra wraps them in its own
        return [f"{path}._target_={target_name!r} cannot be imported: {err}"]
    accepted = accepted_keywords(target)
    problems = []
    for key in node:
        key = str(key)
        if key in HYDRA_KEYS:
            continue
        if key in app_args:
            problems.append(f"{path}.{key} is passed by the app; remove it from the config")
        elif accepted is not None and key not in accepted:
            problems.append(_refusal(path, key, target_name, accepted))
    for arg in app_args:
        if accepted is not None and arg not in accepted:
            problems.append(
                f"{path}: {target_name} takes no {arg!r}, which the app passes it "
                f"(it takes: {describe(accepted)})"
            )
    return problems
