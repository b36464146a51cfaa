"""``data=tokens`` in the app's config: what is refused before any process starts, and the
tokenizer a prepared dataset brings with it (``tokenizer=prepared``)."""

from __future__ import annotations

import pytest

from llmlab.tokenizer import ByteTokenizer
from llmlab.train.app import ConfigError, build, build_tokenizer, compose_config, validate_config
from llmlab.train.prepare import prepare


@pytest.mark.parametrize(
    "layout",
    [
        ["strategy=pipeline", "trainer.devices=2"],
        ["strategy=nd", "strategy.pipeline=2", "trainer.devices=2"],
        ["strategy=naive_mp"],
    ],
)
def test_document_masking_with_a_pipeline_is_refused_naming_the_option(layout):
    cfg = compose_config(["experiment=gpt_tokens", *layout])
    with pytest.raises(ConfigError, match=r"data.document_mask=true cannot run with pipeline"):
        validate_config(cfg, tokenizer_vocab=257)
    validate_config(compose_config(["experiment=gpt_tokens", *layout, "data.document_mask=false"]))


def test_document_masking_with_context_parallelism_is_refused_naming_the_option():
    layout = ["experiment=gpt_tokens", "strategy=nd", "strategy.context=2", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"document_mask=true cannot run with context .*=2\)"):
        validate_config(compose_config(layout), tokenizer_vocab=257)
    validate_config(compose_config([*layout, "data.document_mask=false"]), tokenizer_vocab=257)


def test_a_model_vocabulary_smaller_than_the_data_ids_is_refused():
    cfg = compose_config(["experiment=gpt_tokens", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the .* 257 ids"):
        validate_config(cfg, tokenizer_vocab=257)


def test_the_prepared_tokenizer_comes_with_the_data_and_a_damaged_shard_is_a_config_error(
    tmp_path,
):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} of the corpus"}}\n' for i in range(60)))
    data = tmp_path / "data"
    prepare([str(corpus)], data, shard_tokens=500, val_fraction=0.5, progress=False)
    cfg = compose_config(["experiment=gpt_tokens", f"data.dir={data}", "model.block_size=16",
                          "data.batch_size=4"])  # fmt: skip
    tokenizer = build_tokenizer(cfg)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == 257
    build(cfg.data, "datamodule", tokenizer=tokenizer)  # a sound dataset builds
    shard = data / "train" / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"TokenDataModule>: .*shard_00000\.bin is truncated"):
        build(cfg.data, "datamodule", tokenizer=tokenizer)
