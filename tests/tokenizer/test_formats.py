"""One ``load(path)`` for every family and every format it writes: each ``save``d file comes back
as the same family with the same vocabulary, special tokens and ids (no reference needed: the
tokenizer before saving is the oracle; the files' parity with HF, sentencepiece and tiktoken is
checked family by family in the other modules)."""

from __future__ import annotations

import pytest

import llmlab.tokenizer as lt
from llmlab.tokenizer.formats import MODEL_CLASSES
from tests.tokenizer.corpus import held_out_text, train_files

SAMPLE = "To be, or not to be — naïve café 🙂 Ωμέγα\t\n  x<|endoftext|>"


@pytest.fixture(scope="module")
def lines() -> list[str]:
    files = train_files(0.05)
    return [ln for f in files for ln in f.read_text(encoding="utf-8").splitlines()]


def _train(cls: type[lt.TokenizerBase], lines: list[str]) -> lt.TokenizerBase:
    if cls is lt.BPETokenizer:
        return cls.train(lines, 400, pattern="gpt4", special_tokens=["<|endoftext|>"])
    if cls is lt.WordPieceTokenizer:
        return cls.train(lines, 400)
    if cls is lt.UnigramTokenizer:
        return cls.train(lines[:600], 250)
    return cls.train(lines, 400)


@pytest.fixture(scope="module", params=MODEL_CLASSES, ids=lambda c: c.__name__)
def trained(request, lines) -> lt.TokenizerBase:
    return _train(request.param, lines)


def test_every_family_saves_every_format_and_load_reads_it_back(trained, tmp_path):
    text = SAMPLE + held_out_text(3000)
    expected = trained.encode(text, allowed_special="all")
    assert trained.save_formats[:2] == ("llmlab", "hf")  # every family has both
    for fmt in trained.save_formats:
        path = trained.save(tmp_path / f"{fmt}.out", format=fmt)
        options = {}
        if fmt == "tiktoken":  # ranks carry no pattern or special tokens
            options = {"pattern": trained.pattern, "special_tokens": trained.special_tokens}
        loaded = lt.load(path, **options)
        assert type(loaded) is type(trained), fmt
        assert loaded.vocab_size == trained.vocab_size, fmt
        assert loaded.special_tokens == trained.special_tokens, fmt
        assert loaded.encode(text, allowed_special="all") == expected, fmt
        assert loaded.decode(expected) == trained.decode(expected), fmt
        # and the loaded one writes the same file again: nothing lost in the round trip
        again = loaded.save(tmp_path / f"{fmt}.again", format=fmt)
        if again.is_file():
            assert again.read_bytes() == path.read_bytes(), fmt


def test_an_unknown_format_is_refused_naming_the_valid_ones(trained, tmp_path):
    with pytest.raises(ValueError, match="formats: llmlab, hf"):
        trained.save(tmp_path / "x", format="protobuf")
