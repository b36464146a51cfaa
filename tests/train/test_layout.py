"""The parallel layout is checked from the config alone: world, batch split, model shape."""

from __future__ import annotations

import pytest

from llmlab.train.app import ConfigError, compose_config, experiments_dir, validate_config
from llmlab.train.layout import Layout, layout_from_config, layout_problems, spelling_of


def test_both_spellings_of_the_pipeline_degree_read_the_same():
    nd = {"data": 2, "pipeline": 2, "tensor": 1, "virtual_stages": 2, "microbatches": 4}
    today = {"stages": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": None}
    expected = Layout(world_size=4, pipeline=2, virtual_stages=2, microbatches=4)
    assert layout_from_config(nd, 4) == Layout(**{**vars(expected), "data": 2})
    assert layout_from_config(today, 4) == expected  # interleaved: 2 chunks per rank
    assert spelling_of(today) == {"pipeline": "strategy.stages"} and spelling_of(nd) == {}
    with pytest.raises(ValueError, match=r"strategy.pipeline=2 and strategy.stages=4"):
        layout_from_config({"pipeline": 2, "stages": 4}, 8)


def test_a_strategy_without_layout_keys_is_data_parallel_over_the_world():
    assert layout_from_config({"find_unused_parameters": False}, 2, num_nodes=2) == Layout(4)
    assert Layout(4).data_parallel == 4
    ps = layout_from_config({"num_servers": 1, "mode": "sync"}, 3)
    assert ps.data_parallel == 2  # the server holds no data
    assert layout_problems(ps, global_batch=32) == []


@pytest.mark.parametrize(
    "layout, kwargs, message",
    [
        (Layout(4, data=2, tensor=2, pipeline=2), {},
         "strategy.data (2) × strategy.pipeline (2) × strategy.tensor (2) = 8 ranks, but "
         "trainer.devices × trainer.num_nodes = 4"),
        (Layout(3, tensor=2), {}, "trainer.devices × trainer.num_nodes = 3 is not divisible by "
         "strategy.pipeline (1) × strategy.tensor (2) = 2"),
        (Layout(4, pipeline=2, microbatches=4), {"global_batch": 20},
         "data.batch_size=20 (global) cannot be split into 2 data-parallel replica(s) × 4 "
         "micro-batches = 8 equal parts; use a multiple of 8"),
        (Layout(3), {"global_batch": 32}, "data.batch_size=32 (global) cannot be split into 3 "
         "data-parallel replica(s) = 3 equal parts"),
        (Layout(2, pipeline=2, virtual_stages=4), {"pipeline_layers": 6},
         "the model has 6 pipeline layers (model.pipeline_layers()), fewer than strategy.pipeline "
         "(2) × strategy.virtual_stages (4) = 8 stages"),
        (Layout(2, tensor=2), {"tensor_divisors": {"n_head": 3, "n_embd": 48}},
         "model.n_head=3 is not divisible by strategy.tensor=2"),
        (Layout(2, tensor=0), {}, "strategy.tensor=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_each_layout_problem_names_its_numbers(layout, kwargs, message):
    problems = layout_problems(layout, **kwargs)
    assert any(message in p for p in problems), problems


def test_a_layout_that_fits_has_no_problems():
    layout = Layout(8, data=2, pipeline=2, tensor=2, virtual_stages=2, microbatches=4)
    divisors = {"n_head": 4, "n_embd": 128, "vocab_size": 256}
    assert layout_problems(layout, 32, pipeline_layers=6, tensor_divisors=divisors) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["experiment=gpt_tp2", "model.n_head=3", "model.n_embd=48"],
         r"^model.n_head=3 is not divisible by strategy.tensor=2$"),
        (["experiment=gpt_tp2", "model.n_layer=2", "+model.vocab_size=255"],
         r"model.vocab_size=255 is not divisible by strategy.tensor=2"),
        (["experiment=gpt_pp2_gpipe", "model.n_layer=1", "strategy.stages=4", "trainer.devices=4"],
         r"the model has 3 pipeline layers .* fewer than strategy.stages \(4\)"),
        (["experiment=gpt_pp2_dp2", "data.batch_size=12"], r"use a multiple of 8"),
        (["experiment=gpt_tp2_dp2", "trainer.devices=2"], r"= 4 ranks, but trainer.devices"),
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
