"""Training with expert parallelism equals one process (issue 38, Done-when 3, first layouts).

A tiny Mixtral-style Llama (4 experts, top-2, every layer a mixture of experts; the matrix's
32-wide Llama otherwise) trains 3 steps through the app's own config path (``compose_config`` →
``validate_config`` → ``build_strategy`` → ``hand_model_transforms``), exactly as a composition
matrix cell does, with ``strategy=nd`` and ``strategy.expert=2``, and is compared with the
single-process run: the logged loss (the global token mean) within 1e-5 and the logged and the
independently computed gradient norms within 1e-5 (relative; fp32 sums in another order).

This is a focused file rather than a model and a layout in ``composition_cells``: a "moe" model
there would multiply every strategy (pipeline, tensor, DeepSpeed, parameter servers, ZeRO, ...)
and each of those cells would need its own exact run or refusal before the matrix could hold,
and an "nd-...-ep2" layout with the dense models would be refused in every cell. The refusals
``strategy.expert`` has today are checked here against ``validate_config``.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.helpers.distributed import run_distributed
from tests.integration.composition_cells import MODELS

MOE = [
    *MODELS["llama"],
    "+model.num_experts=4",
    "+model.num_experts_per_tok=2",
    "+model.moe_intermediate_size=32",
]
STEPS = 3
REL = 1e-5  # fp32: the loss and both norms (the reductions sum in another order)
LAYOUTS = {  # name -> (devices, strategy overrides)
    "dp2-ep2": (2, ["strategy=nd", "strategy.data=2", "strategy.expert=2"]),
    "cp2-ep2": (2, ["strategy=nd", "strategy.context=2", "strategy.expert=2"]),
    "dp4-ep2": (4, ["strategy=nd", "strategy.data=4", "strategy.expert=2"]),
}


def _overrides(devices: int, strategy: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    return [*MOE, *strategy, f"trainer.devices={devices}", "precision=fp32", *extra]


def _fit(overrides: list[str], devices: int) -> dict:
    from omegaconf import OmegaConf

    from llmlab.train.app import (
        build_precision,
        build_strategy,
        compose_config,
        hand_model_transforms,
        validate_config,
    )
    from tests.helpers.training import fit

    cfg = compose_config(overrides)
    OmegaConf.set_struct(cfg, False)
    run = validate_config(cfg)
    strategy = build_strategy(cfg, run.transforms)
    precision, plugins = build_precision(cfg)
    out = fit(
        strategy,
        devices,
        OmegaConf.to_container(cfg.model, resolve=True),
        steps=STEPS,
        plugins=plugins,
        precision=precision,
        prepare=lambda s, task: hand_model_transforms(cfg, s, task, run.transforms),
    )
    result = {k: out[k] for k in ("losses", "norms", "master_norm")}
    parallel = getattr(strategy, "parallel", None)
    if parallel is not None:
        layers = out["trainer"].lightning_module.model.moe_layers().values()
        result["experts_held"] = [tuple(m.experts.gate_proj.shape) for m in layers]
        result["applied"] = parallel.applied.get("expert_parallel")
        result["ep_bytes"] = strategy.last_comm.get("comm/ep_bytes")
    return result


def _rank_fit(rank: int, world: int, overrides: list[str]) -> dict:
    return _fit(overrides, world)


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == STEPS, (what, got, want)
    for a, b in zip(got, want, strict=True):
        assert math.isfinite(a) and abs(a - b) <= REL * abs(b), (what, got, want)


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _fit(_overrides(1, ["strategy=auto"]), 1)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_training_equals_one_process(layout: str, one_process: dict) -> None:
    """Experts split over 2 ranks of data (or context; or of data 4: two copies of each expert):
    every rank's loss, logged norm and first-step gradient norm equal one process's; each rank
    holds 2 of the 4 experts of both MoE layers and sent rows through the all-to-all."""
    devices, strategy = LAYOUTS[layout]
    results = run_distributed(_rank_fit, devices, _overrides(devices, strategy), timeout=900)
    for r in results:
        _close(r["losses"], one_process["losses"], f"{layout} loss")
        _close(r["norms"], one_process["norms"], f"{layout} train/grad_norm")
        _close([r["master_norm"]] * STEPS, [one_process["master_norm"]] * STEPS, f"{layout} master")
        assert r["experts_held"] == [(2, 32, 32)] * 2 and r["applied"] == 2, r
        assert r["ep_bytes"] > 0, r


REFUSED = {  # an option expert > 1 does not compose with yet -> what the message says
    ("strategy.pipeline=2",): "strategy.expert=2 with strategy.pipeline=2 is refused",
    ("strategy.tensor=2",): "strategy.expert=2 with strategy.tensor=2 is refused",
    ("strategy.zero=1",): "strategy.expert=2 with strategy.zero=1 is refused",
    ("strategy.zero=3", "strategy.zero_impl=fsdp2"): "with strategy.zero=3 is refused",
    ("compile=true",): "strategy.expert=2 with compile=True is refused",
    ("+model_transforms.activation_checkpointing=1",): "with activation_checkpointing=1 is",
    ("precision=bf16_mixed",): "checked against one process in fp32 only",
    ("strategy.sharded_checkpoints=true",): "with strategy.sharded_checkpoints=True is refused",
    ("strategy.expert=3",): "expert=3 does not divide data (4) × context (1) = 4",
}


@pytest.mark.parametrize("extra", list(REFUSED), ids=lambda e: e[0])
def test_what_expert_parallelism_does_not_compose_with_is_refused_up_front(extra) -> None:
    from llmlab.train.app import ConfigError, compose_config, validate_config

    overrides = _overrides(4, ["strategy=nd", "strategy.expert=2"], extra)
    with pytest.raises(ConfigError, match=re.escape(REFUSED[extra])):
        validate_config(compose_config(overrides))


def test_an_expert_degree_on_a_dense_model_is_refused() -> None:
    """expert=2 would change nothing on a model without experts: an error, before any launch."""
    from llmlab.train.app import ConfigError, compose_config, validate_config

    overrides = [*MODELS["llama"], "strategy=nd", "strategy.expert=2", "trainer.devices=2"]
    with pytest.raises(ConfigError, match="found no mixture-of-experts layer in Llama"):
        validate_config(compose_config(overrides))
