"""A key that nothing reads fails at composition, naming the key, its reader and what it takes.

Hydra refuses unknown *override* keys itself; these are keys that config groups, experiment files
and ``+key=value`` additions bring in, which used to reach a target as an unexpected keyword once
processes had started, or vanish into a ``**kwargs``.
"""

from __future__ import annotations

import pytest

from llmlab.train.app import ConfigError, compose_config
from llmlab.train.config_keys import accepted_keywords


def test_a_typo_in_an_experiment_file_names_the_key_the_target_and_what_it_takes(
    tmp_path, monkeypatch
):
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    (experiments / "typo.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /strategy: tensor\n"
        "trainer:\n  devices: 2\n"
        "strategy:\n  tensr: 2\n"
    )
    monkeypatch.setenv("LLMLAB_EXPERIMENTS_DIR", str(experiments))
    with pytest.raises(ConfigError) as err:
        compose_config(["experiment=typo"])
    message = str(err.value)
    assert "strategy.tensr" in message
    assert "llmlab.parallel.presets.TensorParallelStrategy takes no 'tensr'" in message
    assert "did you mean 'tensor'?" in message
    assert "tensor, sequence_parallel, data (TensorParallelStrategy)" in message
    assert "model_attribute" in message and "(NDParallelStrategy)" in message  # what it inherits
    assert "\n" not in message  # one line after "error: "


PL = "lightning.pytorch"
REFUSED = [
    (["+trainer.max_step=5"], f"trainer.max_step: {PL}.Trainer takes no 'max_step' (did you mean"),
    (["+trainer.strategy=ddp"], "trainer.strategy is set by the strategy group"),
    (["+trainr.devices=2"], "trainr: the config takes no 'trainr' (did you mean 'trainer'?)"),
    (["+paths.output=x"], "paths.output: paths takes no 'output'"),
    (["+logger.projet=x"], "logger.projet: the app takes no 'projet' (did you mean 'project'?)"),
    (["+callbacks.checkpoint.monitr=x"], f"{PL}.callbacks.ModelCheckpoint takes no 'monitr'"),
    (
        ["precision=fp16_master", "+precision.plugin.growth_intervall=5"],
        "precision.plugin.growth_intervall: llmlab.parallel.precision.FP16MasterPrecision",
    ),
    (["+task.lrr=1"], "task.lrr: llmlab.train.task.CausalLMTask takes no 'lrr'"),
    (["+tokenizer.vocab_size=5"], "llmlab.train.data.ByteTokenizer takes no 'vocab_size'"),
    (["+task.model.n_layer=2"], "task.model is passed by the app"),
    (["+callbacks.extra.every=2"], "callbacks.extra has no _target_"),
]


@pytest.mark.parametrize("args, expected", REFUSED)
def test_keys_nothing_reads_are_refused(args, expected):
    with pytest.raises(ConfigError) as err:
        compose_config(args)
    assert expected in str(err.value)


def test_ddp_keyword_arguments_are_followed_into_distributed_data_parallel():
    """DDPStrategy hands its **kwargs to torch's DistributedDataParallel: those are accepted,
    anything else is refused with DDP's names listed (it failed once DDP wrapped the model)."""
    compose_config(["experiment=gpt_ddp", "+strategy.static_graph=true"])
    compose_config(["experiment=gpt_pp2_1f1b", "+strategy.gradient_as_bucket_view=true"])
    typo = r"strategy.bucket_mb: .*Strategy takes no 'bucket_mb' \(did you mean 'bucket_cap_mb'\?\)"
    with pytest.raises(ConfigError, match=typo):
        compose_config(["experiment=gpt_dp_bucketed", "+strategy.bucket_mb=1"])
    with pytest.raises(ConfigError, match=r"find_unused_parameters.*\(DistributedDataParallel\)"):
        compose_config(["experiment=gpt_ddp", "+strategy.bogus=1"])


def test_a_tokenizer_the_data_module_cannot_take_is_an_error_not_dropped():
    message = r"data: llmlab.train.vision.ImageDataModule takes no 'tokenizer', which the app"
    with pytest.raises(ConfigError, match=message):
        compose_config(["experiment=resnet50_pp2", "tokenizer=byte"])


def test_a_target_that_does_not_import_is_named():
    with pytest.raises(ConfigError, match=r"strategy._target_='llmlab.nope.Strategy' cannot be "):
        compose_config(["experiment=gpt_ddp", "strategy._target_=llmlab.nope.Strategy"])


class _Base:
    def __init__(self, a: int = 1, b: int = 2) -> None:
        self.a, self.b = a, b


class _Child(_Base):
    def __init__(self, c: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.c = c


class _Keeps:
    def __init__(self, d: int = 4, **options) -> None:
        self.options = options  # not passed on: where they go is unknown


def _function(x: int, *, y: int = 0, **rest) -> None: ...


def test_accepted_keywords_follow_kwargs_up_the_class_hierarchy():
    assert accepted_keywords(_Child) == {"c": "_Child", "a": "_Base", "b": "_Base"}
    assert accepted_keywords(_Base) == {"a": "_Base", "b": "_Base"}
    assert accepted_keywords(_Keeps) is None  # anything goes: nothing can be checked
    assert accepted_keywords(_function) is None
    assert list(accepted_keywords(lambda x, *, y=0: None)) == ["x", "y"]
