"""Misconfigurations fail before any training work, with a message naming the values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmlab.models import GPT, GPTConfig
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.partition import balanced_boundaries, split_ranges
from llmlab.parallel.pipeline.schedules import validate_schedule_args
from llmlab.parallel.pipeline.stage import cut_stage, pipeline_layers_of


def tiny() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="has 4 pipeline layers, fewer than the 5 stages"):
        cut_stage(tiny().pipeline_layers(), 5, 0)


def test_model_without_pipeline_layers():
    with pytest.raises(TypeError, match=r"Linear has no pipeline_layers\(\) method"):
        pipeline_layers_of(nn.Linear(2, 2))


def test_batch_not_divisible_by_microbatches():
    model = tiny()
    engine = PipelineEngine([nn.Sequential(*model.pipeline_layers())], 0, 1, loss_fn=None)
    ids = torch.zeros(6, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="batch of 6 samples cannot be split into 4 equal"):
        engine.train_step(ids, ids, 4, "gpipe")


def test_world_size_not_divisible_by_stages():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from llmlab.parallel.presets import PipelineStrategy

    env = LightningEnvironment()
    env.set_world_size(3)
    strategy = PipelineStrategy(stages=2, microbatches=2, cluster_environment=env)
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by pipeline \(2\)"):
        _ = strategy.dims


def test_strategy_checks_batch_size_and_schedule_arguments():
    from llmlab.parallel.mesh import ParallelDims
    from llmlab.parallel.presets import PipelineStrategy

    with pytest.raises(
        ValueError, match=r"num_microbatches \(6\) to be a multiple of num_stages \(4\)"
    ):
        PipelineStrategy(stages=4, microbatches=6, schedule="interleaved")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        PipelineStrategy(stages=2, schedule="pipedream")
    # the split-backward schedules run in the strategy; the V shapes hold exactly 2 chunks
    assert PipelineStrategy(stages=2, microbatches=4, schedule="zbv").requested.virtual_stages == 2
    assert PipelineStrategy(stages=2, schedule="zb1").requested.virtual_stages == 1
    with pytest.raises(ValueError, match=r"'zb1' schedule \(split backward\) needs a runner"):
        validate_schedule_args("zb1", 2, 4)  # a caller that runs whole backwards only
    with pytest.raises(ValueError, match=r"'zbv' schedule places exactly 2 chunks .* "
                       r"got virtual_stages=3"):  # fmt: skip
        PipelineStrategy(stages=2, microbatches=4, schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match=r"dualpipev schedule needs num_microbatches \(2\) >= "):
        PipelineStrategy(stages=2, microbatches=2, schedule="dualpipev")
    from llmlab.parallel.mesh import check_layout

    layout = ParallelDims(data=2, pipeline=2, microbatches=4)
    with pytest.raises(ValueError, match=r"global batch 12 is not divisible by data \(2\) × "
                       r"microbatches \(4\) = 8"):  # fmt: skip
        check_layout(layout, model=tiny(), global_batch=12)
    interleaved = ParallelDims(pipeline=2, schedule="interleaved", virtual_stages=3, microbatches=2)
    with pytest.raises(ValueError, match=r"4 pipeline layers, fewer than pipeline \(2\) × "
                       r"virtual stages \(3\)"):  # fmt: skip
        check_layout(interleaved, model=tiny())


def test_explicit_and_balanced_boundaries():
    layers = tiny().pipeline_layers()
    assert [list(r) for r in split_ranges(layers, 2, [3])] == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="must lie in"):
        split_ranges(layers, 2, [4])
    with pytest.raises(ValueError, match="give 3 stages, but 2 are needed"):
        split_ranges(layers, 2, [1, 2])
    # the exact min-max split: [4, 1, 1, 4] into 2 parts -> [4, 1] | [1, 4]
    assert balanced_boundaries([4, 1, 1, 4], 2) == [2]
    assert balanced_boundaries([1, 1, 1, 1, 8], 2) == [4]


@pytest.mark.parametrize("schedule", ["zb1", "zbv", "dualpipev"])
def test_split_backward_refuses_what_it_cannot_run_exactly(schedule):
    """compile=true (a compiled block's backward is one node: W would rerun it) and fp8's delayed
    recipe (B and W would both advance the amax history) are refused when the strategy is built
    or its config checked, naming the values; dynamic fp8 and unsplit schedules pass."""
    from llmlab.parallel.preflight import RunConfig
    from llmlab.parallel.strategy import NDParallelStrategy

    layout = dict(pipeline=2, schedule=schedule, microbatches=4)
    with pytest.raises(ValueError, match=f"compile=true with schedule='{schedule}' is refused"):
        NDParallelStrategy(**layout, transforms={"compile": True})
    NDParallelStrategy(pipeline=2, schedule="1f1b", transforms={"compile": True})
    fp8 = {"_target_": "llmlab.parallel.precision.FP8Precision", "recipe": "delayed"}
    run = RunConfig(world_size=2, global_batch=8, plugin_options=fp8, build_model=tiny)
    with pytest.raises(ValueError, match=f"fp8 recipe='delayed' with schedule='{schedule}'"):
        NDParallelStrategy.check_config(layout, run)
    NDParallelStrategy.check_config(layout, RunConfig(world_size=2, global_batch=8,
                                    plugin_options={**fp8, "recipe": "dynamic"},
                                    build_model=tiny))  # fmt: skip
    NDParallelStrategy.check_config({**layout, "schedule": "1f1b"}, run)


def test_the_app_refuses_delayed_fp8_with_a_split_schedule_before_training():
    from llmlab.train.app import ConfigError, compose_config, validate_config

    args = ["experiment=gpt_pp2_gpipe", "strategy.schedule=zbv", "precision=fp8"]
    validate_config(compose_config(args))
    with pytest.raises(ConfigError, match=r"fp8 recipe='delayed' with schedule='zbv'"):
        validate_config(compose_config([*args, "precision.plugin.recipe=delayed"]))
