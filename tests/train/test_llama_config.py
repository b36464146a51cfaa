"""The train app validates a Llama config through the model registry, before any work starts."""

from __future__ import annotations

import pytest

from llmlab.train.app import ConfigError, compose_config, validate_config


def test_llama_experiment_selects_the_llama_model_group():
    cfg = compose_config(["experiment=llama_shakespeare"])
    assert cfg.model.arch == "llama" and cfg.model.n_kv_head == 2
    validate_config(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_kv_head=3", r"model.n_head=4 is not divisible by n_kv_head=3.*\[1, 2, 4\]"),
        ("model.n_embd=36", r"model.n_embd=36 / n_head=4 = 9, the head dim, must be even"),
        ("model.arch=mamba", r"unknown model arch 'mamba'; valid: \['gpt', 'llama'\]"),
    ],
)
def test_bad_llama_config_names_the_value(override, message):
    cfg = compose_config(["experiment=llama_shakespeare", override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
