"""``validate_config`` accepts exactly the cells the composition matrix lists (issue 24).

The whole config space (``composition_cells.CELLS``: model × layout × ZeRO × precision × memory
× kernels × compile × checkpoint, the product of the axes) goes through the app's own
``validate_config``; every cell it accepts must be a listed supported cell (one the matrix
trains and compares with one process) and every cell it refuses must be listed refused, with a
message containing the listed reason. Nothing runs: this is the fast, non-distributed half.

Composing each of the ~9k configs with Hydra would take about an hour, so each config group is
composed once (a strategy with its layout keys, a model, a precision) and a cell's config is
the composed strategy config with the model and precision nodes put in and the scalar keys
set; ``test_the_cheap_configs_are_the_composed_ones`` checks that this is the config
``compose_config(cell.overrides())`` gives, on one cell per layout.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import pytest

from tests.integration.composition_cells import (
    AXES,
    CELLS,
    MODELS,
    PIPELINE_KEYS,
    PRECISIONS,
    REQUIRED,
    STRATEGIES,
    WHY_REFUSED,
    Cell,
)


@cache
def _composed(*overrides: str) -> Any:
    from llmlab.train.app import compose_config

    return compose_config(list(overrides))


@cache
def _groups(strategy: str, model: str, precision: str) -> Any:
    """The strategy's composed config (with its layout keys) holding ``model`` and
    ``precision``'s composed nodes; the cells of these three share it and set their scalars."""
    from omegaconf import OmegaConf

    layout = STRATEGIES[strategy]
    extra = PIPELINE_KEYS if layout.pipelined else []
    base = _composed(*MODELS["gpt"], *layout.overrides, *extra, f"trainer.devices={layout.devices}")
    cfg = base.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.model = _composed(*MODELS[model]).model
    cfg.precision = _composed(*PRECISIONS[precision]).precision
    return cfg


TRANSFORMS = {
    "none": {},
    "activation_checkpointing": {"activation_checkpointing": 1},
    "recompute_attention": {"recompute_attention": 8},
}


def cheap_config(cell: Cell) -> Any:
    """``compose_config(cell.overrides())``, from the groups composed once each (the object is
    shared with the cells of the same strategy, model and precision: use it before the next)."""
    cfg = _groups(cell.strategy, cell.model, cell.precision)
    cfg.model.kernels = cell.kernels
    cfg.compile = cell.compile == "compile"
    cfg.model_transforms = TRANSFORMS[cell.memory]
    if cell.layout.nd:
        cfg.strategy.zero = int(cell.zero[-1])
        cfg.strategy.zero_impl = "fsdp2" if cell.zero.startswith("fsdp2") else "llmlab"
        cfg.strategy.sharded_checkpoints = cell.checkpoint == "sharded"
    return cfg


def _verdict(cell: Cell) -> str | None:
    """``None`` when ``validate_config`` accepts the cell's config, else its message."""
    from llmlab.train.app import ConfigError, validate_config

    try:
        validate_config(cheap_config(cell))
    except ConfigError as err:
        return str(err)
    return None


def test_the_cheap_configs_are_the_composed_ones() -> None:
    from omegaconf import OmegaConf

    sample = [next(c for i, c in enumerate(CELLS) if c.strategy == s and i % 7 == k % 7)
              for k, s in enumerate(STRATEGIES)] + REQUIRED  # fmt: skip
    for cell in sample:
        want = OmegaConf.to_container(_composed(*cell.overrides()))
        got = OmegaConf.to_container(cheap_config(cell))
        assert got == want, cell.id


def test_validate_config_accepts_exactly_the_listed_cells() -> None:
    """Both directions, on the whole product: accepted ⇔ listed supported, and every refusal
    raises the listed reason."""
    wrong = []
    for cell in CELLS:
        message, listed = _verdict(cell), cell.refused
        if listed is None and message is not None:
            wrong.append(f"{cell.id}: listed supported, validate_config refused: {message}")
        elif listed is not None and message is None:
            wrong.append(f"{cell.id}: listed refused ({listed!r}), validate_config accepted")
        elif listed is not None and not re.search(re.escape(listed), message):
            wrong.append(f"{cell.id}: listed {listed!r}, validate_config said: {message}")
    assert not wrong, f"{len(wrong)} of {len(CELLS)} cells:\n" + "\n".join(wrong[:40])


def test_the_space_is_the_product_of_the_axes() -> None:
    """Every axis value appears; the N-D strategy takes every ZeRO and checkpoint value, the
    others only the defaults (their configs have no such key: composing one is refused)."""
    from llmlab.train.app import ConfigError, compose_config

    nd = [s for s, layout in STRATEGIES.items() if layout.nd]
    others = len(STRATEGIES) - len(nd)
    per_layout = 1
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in CELLS} == set(values), axis
        if axis not in ("strategy", "zero", "checkpoint"):
            per_layout *= len(values)
    nd_size = len(AXES["zero"]) * len(AXES["checkpoint"]) * per_layout
    assert len(CELLS) == len(set(CELLS)) == (len(nd) * nd_size + others * per_layout)
    for cell in CELLS:
        assert cell.refused is None or cell.refused in WHY_REFUSED
    for key in ("strategy.zero=1", "strategy.sharded_checkpoints=true"):
        with pytest.raises(ConfigError, match=r"\bzero\b|sharded_checkpoints"):
            compose_config([*MODELS["gpt"], "strategy=ddp", "trainer.devices=2", key])
