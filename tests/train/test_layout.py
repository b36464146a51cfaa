"""The parallel layout is checked from the config alone: world, batch split, model shape.

One function judges a layout (``llmlab.parallel.mesh.check_layout``); the app reaches it through
the strategy's own ``check_config``, with the model built on the ``meta`` device.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.parallel.mesh import ParallelDims, check_layout, layout_problems
from llmlab.parallel.preflight import RunConfig, check_strategy_config
from llmlab.train.app import ConfigError, compose_config, validate_config
from llmlab.train.compose import experiments_dir


def _gpt(**fields):
    from llmlab.models import GPT, GPTConfig

    config = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=16) | fields
    with torch.device("meta"):
        return GPT(GPTConfig(**config))


def test_both_spellings_of_the_pipeline_degree_read_the_same():
    from llmlab.parallel.presets import PipelineStrategy
    from llmlab.parallel.strategy import NDParallelStrategy

    nd = NDParallelStrategy(data=2, pipeline=2, microbatches=4, schedule="interleaved")
    preset = PipelineStrategy(stages=2, microbatches=4, schedule="interleaved")
    assert preset.requested == ParallelDims(
        data=None, pipeline=2, microbatches=4, schedule="interleaved", virtual_stages=2
    )  # interleaved: 2 chunks per rank
    assert nd.requested.resolve(4) == preset.requested.resolve(4)
    with pytest.raises(ValueError, match=r"pipeline=4 and stages=2 are two spellings"):
        PipelineStrategy(stages=2, pipeline=4)


def test_a_strategy_without_layout_keys_is_data_parallel_over_the_world():
    from lightning.pytorch.strategies import DDPStrategy

    from llmlab.parallel.data import ParameterServerStrategy

    check_strategy_config(DDPStrategy, {"find_unused_parameters": False}, RunConfig(4, 32))
    with pytest.raises(ValueError, match=r"global batch 30 is not divisible by data \(4\)"):
        check_strategy_config(DDPStrategy, {}, RunConfig(4, 30))
    ps = {"num_servers": 1, "mode": "sync"}
    check_strategy_config(ParameterServerStrategy, ps, RunConfig(3, 32))  # 2 workers
    with pytest.raises(ValueError, match=r"global batch 33 is not divisible by data \(2\)"):
        check_strategy_config(ParameterServerStrategy, ps, RunConfig(3, 33))  # servers: no data


@pytest.mark.parametrize(
    "dims, kwargs, message",
    [
        (ParallelDims(data=2, tensor=2, pipeline=2), {"world_size": 4},
         "data (2) × pipeline (2) × tensor (2) = 8, but the world size is 4"),
        (ParallelDims(data=None, tensor=2), {"world_size": 3},
         "world size 3 is not divisible by pipeline (1) × tensor (2) = 2"),
        (ParallelDims(data=None, pipeline=2, microbatches=4), {"world_size": 4, "global_batch": 20},
         "global batch 20 is not divisible by data (2) × microbatches (4) = 8; use a multiple of "
         "8"),
        (ParallelDims(data=None), {"world_size": 3, "global_batch": 32},
         "global batch 32 is not divisible by data (3); use a multiple of 3"),
        (ParallelDims(pipeline=2, schedule="interleaved", virtual_stages=4, microbatches=4),
         {"model": _gpt()},
         "the model has 6 pipeline layers, fewer than pipeline (2) × virtual stages (4) = 8"),
        (ParallelDims(tensor=2), {"model": _gpt(n_head=3, n_embd=48)},
         "model.n_head=3 is not divisible by tensor=2"),
    ],
)  # fmt: skip
def test_each_layout_problem_names_its_numbers(dims, kwargs, message):
    problems = layout_problems(dims, **kwargs)
    assert any(message in p for p in problems), problems
    with pytest.raises(ValueError, match=r"^this layout cannot run: "):
        check_layout(dims, **kwargs)


def test_bad_sizes_are_refused_when_the_layout_is_built():
    with pytest.raises(ValueError, match=r"tensor=0 must be a positive integer"):
        ParallelDims(tensor=0)


def test_a_layout_that_fits_has_no_problems():
    dims = ParallelDims(data=2, pipeline=2, tensor=2, schedule="interleaved", microbatches=4)
    assert layout_problems(dims, 8, _gpt(), 32) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["experiment=gpt_tp2", "model.n_head=3", "model.n_embd=48"],
         r"^this layout cannot run: model.n_head=3 is not divisible by tensor=2$"),
        (["experiment=gpt_tp2", "model.n_layer=2", "+model.vocab_size=255"],
         r"model.vocab_size=255 is not divisible by tensor=2"),
        (["experiment=gpt_pp2_gpipe", "model.n_layer=1", "strategy.stages=4", "trainer.devices=4"],
         r"the model has 3 pipeline layers, fewer than pipeline \(4\)"),
        (["experiment=gpt_pp2_dp2", "data.batch_size=12"], r"use a multiple of 8"),
        (["experiment=gpt_tp2_dp2", "trainer.devices=2"], r"= 4, but the world size is 2"),
        (["experiment=resnet50_pp2", "strategy.stages=8", "trainer.devices=8"],
         r"the model has 6 pipeline layers"),
    ],
)  # fmt: skip
def test_validate_config_checks_the_layout_against_the_model_built_on_meta(args, message):
    cfg = compose_config(args)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_a_model_without_the_tensor_parallel_contract_is_refused_by_name(tmp_path, monkeypatch):
    resnet = (experiments_dir() / "resnet50_naive_mp.yaml").read_text()
    resnet = resnet.replace("override /strategy: naive_mp", "override /strategy: tensor")
    resnet = resnet.replace("  devices: 1\n", "  devices: 2\n")
    resnet = resnet.replace("strategy:\n  devices: [cpu, cpu]\n  microbatches: 4\n", "")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "resnet_tp.yaml").write_text(resnet)
    monkeypatch.setenv("LLMLAB_EXPERIMENTS_DIR", str(tmp_path / "experiments"))
    cfg = compose_config(["experiment=resnet_tp"])
    message = r"ResNet50 cannot be used for tensor parallelism: it has no tensor_parallel_plan"
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
