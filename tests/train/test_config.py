"""Configs are composed from groups + experiment deltas and rejected early when wrong."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from llmlab.train.app import ConfigError, available_experiments, compose_config, validate_config
from tests.helpers.hf_tiny import experiment_user_files
from tests.helpers.runs import REPO, run_train


def test_default_experiment_composes_with_its_tags():
    cfg = compose_config([])
    assert cfg.experiment == "gpt_shakespeare"
    assert "shakespeare" in cfg.tags
    assert cfg.model.n_embd % cfg.model.n_head == 0


def test_experiment_delta_overrides_a_group():
    cfg = compose_config(["experiment=gpt_ddp"])
    assert cfg.strategy._target_.endswith("DDPStrategy")
    assert cfg.trainer.devices == 2


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "experiments").glob("*.yaml")))
def test_every_experiment_composes_and_validates(name, tmp_path):
    cfg = compose_config([f"experiment={name}", *experiment_user_files(name, tmp_path)])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    validate_config(cfg)


def test_bad_head_count_names_the_value_and_valid_choices():
    cfg = compose_config(["model.n_head=5"])
    msg = r"model.n_embd=128 is not divisible by n_head=5.*\[1, 2, 4, 8\]"
    with pytest.raises(ConfigError, match=msg):
        validate_config(cfg)


@pytest.mark.parametrize("precision", ["fp16_master", "bf16_master"])
def test_master_weight_precision_on_a_parameter_server_is_refused(precision):
    cfg = compose_config(["experiment=gpt_ps_sync", f"precision={precision}"])
    with pytest.raises(ConfigError, match=r"cannot run on a parameter server.*fp32, bf16_mixed"):
        validate_config(cfg)
    validate_config(compose_config(["experiment=gpt_ps_sync", "precision=fp8"]))


def test_clipping_by_norm_with_several_async_servers_is_refused():
    overrides = ["strategy=ps_async", "strategy.num_servers=2", "trainer.devices=4"]
    with pytest.raises(ConfigError, match=r"gradient_clip_val=1\.0 .*num_servers=2.*mode=sync"):
        validate_config(compose_config(overrides))
    for fine in ("strategy.mode=sync", "+trainer.gradient_clip_algorithm=value"):
        validate_config(compose_config([*overrides, fine]))


def test_unknown_experiment_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown experiment 'nope'.*gpt_shakespeare"):
        compose_config(["experiment=nope"])
    assert "gpt_ddp" in available_experiments()


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="n_haed"):
        compose_config(["model.n_haed=5"])


def test_cli_exits_with_a_message_before_any_work(tmp_path):
    result = run_train(["model.n_head=5"], tmp_path, timeout=120)
    assert result.returncode == 2
    assert "model.n_embd=128 is not divisible by n_head=5" in result.stderr
    assert not (tmp_path / "gpt_shakespeare").exists()  # no run dir, nothing trained


def test_fp16_master_reads_the_loss_scaler_defaults_from_one_place():
    from llmlab.parallel.precision.scaler import DEFAULTS

    cfg = compose_config(["precision=fp16_master"])
    plugin = OmegaConf.to_container(cfg.precision.plugin, resolve=True)
    assert {k: plugin[k] for k in DEFAULTS} == dict(DEFAULTS)
    cfg = compose_config(["precision=fp16_master", "precision.plugin.growth_interval=500"])
    assert cfg.precision.plugin.growth_interval == 500


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_experiments_set_the_stage_of_the_one_deepspeed_strategy(stage):
    cfg = compose_config([f"experiment=gpt_zero{stage}"])
    assert cfg.strategy._target_.endswith("PortableDeepSpeedStrategy")
    assert cfg.strategy.stage == stage


def test_val_check_interval_must_be_a_whole_number_of_steps():
    with pytest.raises(ConfigError, match=r"trainer.val_check_interval must be a positive integer"):
        validate_config(compose_config(["trainer.val_check_interval=0.5"]))


def test_a_key_of_another_strategy_names_the_spelling_that_works():
    """``strategy.tensor=3`` under the default ``strategy=auto``: Hydra alone would suggest
    ``+strategy.tensor=3``, which the key check then refuses; the message names the options
    that have the key and a spelling that composes."""
    with pytest.raises(ConfigError) as err:
        compose_config(["strategy.tensor=3"])
    message = str(err.value)
    assert "(strategy=auto) has no 'tensor' setting" in message
    assert "strategy=nd, strategy=tensor, strategy=tensor_sp" in message
    assert "`strategy=nd strategy.tensor=3`" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"\(strategy=ddp\) has no 'tensor'"):
        compose_config(["strategy=ddp", "strategy.tensor=3"])
    assert compose_config(["strategy=nd", "strategy.tensor=3"]).strategy.tensor == 3
    assert compose_config(["strategy=tensor", "strategy.tensor=3"]).strategy.tensor == 3
