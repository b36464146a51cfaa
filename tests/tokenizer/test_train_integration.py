"""The BPE tokenizer as the training app uses it: trained on the train split, cached, and
composed by Hydra from experiments/gpt_bpe.yaml."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from llmlab.tokenizer import BPETokenizer

pytest.importorskip("llmlab.train.data")


def test_load_or_train_bpe_caches_by_settings(tmp_path):
    from llmlab.train.bpe_cache import load_or_train_bpe

    first = load_or_train_bpe(vocab_size=300, cache_dir=str(tmp_path), max_bytes=200_000)
    cached = list((tmp_path / "tokenizers").glob("bpe-*.json"))
    assert len(cached) == 1 and first.vocab_size == 300
    again = load_or_train_bpe(vocab_size=300, cache_dir=str(tmp_path), max_bytes=200_000)
    assert again.ranks == first.ranks and again.fingerprint == first.fingerprint
    other = load_or_train_bpe(vocab_size=320, cache_dir=str(tmp_path), max_bytes=200_000)
    assert other.vocab_size == 320
    assert len(list((tmp_path / "tokenizers").glob("bpe-*.json"))) == 2
    assert first.eos_token_id == 0


def test_trained_on_train_split_only(tmp_path):
    from llmlab.train.bpe_cache import load_or_train_bpe
    from llmlab.train.data import corpus_files

    files = corpus_files("shakespeare")["train"]
    expected = BPETokenizer.train_from_files(files[:1], 300, special_tokens=["<|endoftext|>"])
    first_file_bytes = Path(files[0]).stat().st_size
    got = load_or_train_bpe(vocab_size=300, cache_dir=str(tmp_path), max_bytes=first_file_bytes)
    assert got.merges == expected.merges


def test_pickle_is_stable_and_small():
    tok = BPETokenizer.train(["hello world, hello there"] * 10, 270, pattern="gpt2")
    before = pickle.dumps(tok)
    tok.encode("hello world")  # builds the tiktoken Encoding and fills the cache
    assert pickle.dumps(tok) == before
    assert pickle.loads(before).encode("hello there") == tok.encode("hello there")


def test_experiment_composes_with_bpe_tokenizer(tmp_path, monkeypatch):
    app = pytest.importorskip("llmlab.train.app")
    from hydra.utils import instantiate

    monkeypatch.setenv("LLMLAB_OUTPUT_DIR", str(tmp_path))
    cfg = app.compose_config(
        ["experiment=gpt_bpe", "tokenizer.max_bytes=100000", "tokenizer.vocab_size=300"]
    )
    assert cfg.tokenizer._target_ == "llmlab.train.bpe_cache.load_or_train_bpe"
    assert "bpe" in cfg.tags
    tok = instantiate(cfg.tokenizer, _convert_="all")
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
    assert str(tmp_path) in str(cfg.tokenizer.cache_dir)
