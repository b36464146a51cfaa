"""BPE against tiktoken: exported ranks in tiktoken's own Encoding, the two llmlab encoders, and
the real GPT-2 / cl100k_base / o200k_base vocabularies loaded from offline files."""

from __future__ import annotations

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

import llmlab.tokenizer as lt
from llmlab.tokenizer import BPETokenizer
from tests.tokenizer.corpus import (
    MIXED,
    gpt2_files,
    held_out_text,
    tiktoken_encoding,
    tiktoken_gz,
    train_files,
)

SPECIALS = ["<|endoftext|>", "<|fim_prefix|>"]


@pytest.fixture(scope="module")
def trained() -> BPETokenizer:
    return BPETokenizer.train_from_files(
        train_files(0.5), 1500, pattern="gpt4", special_tokens=SPECIALS
    )


def test_exported_ranks_in_tiktoken_encode_like_llmlab(trained, tmp_path):
    path = lt.save(trained, tmp_path / "ranks.tiktoken", format="tiktoken")
    enc = tiktoken.Encoding(
        "test",
        pat_str=trained.pattern,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens=trained.special_tokens,
    )
    reference = trained.with_backend("reference")
    for text in (held_out_text(100_000), MIXED, "<|endoftext|>x<|fim_prefix|>"):
        expected = enc.encode(text, allowed_special="all")
        assert trained.encode(text, allowed_special="all") == expected
        assert reference.encode(text, allowed_special="all") == expected
    # and back: load() reads the .tiktoken file with the pattern and specials as options
    again = lt.load(path, pattern="gpt4", special_tokens=trained.special_tokens)
    assert again.encode(MIXED) == trained.encode(MIXED)


def test_fast_path_is_used_automatically(trained):
    assert trained.backend == "tiktoken"
    assert trained.with_backend("reference").backend == "reference"


def test_special_tokens_follow_tiktoken_semantics(trained):
    text = "a<|endoftext|>b"
    for tok in (trained, trained.with_backend("reference")):
        with pytest.raises(ValueError, match="disallowed special token"):
            tok.encode(text)
        ids = tok.encode(text, allowed_special={"<|endoftext|>"})
        assert trained.special_tokens["<|endoftext|>"] in ids
        plain = tok.encode(text, disallowed_special=())
        assert trained.special_tokens["<|endoftext|>"] not in plain
        assert tok.decode(plain) == text == tok.decode(ids)
        # allowing one special still refuses the others
        with pytest.raises(ValueError, match="fim_prefix"):
            tok.encode("<|fim_prefix|>", allowed_special={"<|endoftext|>"})


def test_encode_batch_matches_encode(trained):
    texts = MIXED.split("\n")
    expected = [trained.encode(t) for t in texts]
    assert trained.encode_batch(texts) == expected
    assert trained.with_backend("reference").encode_batch(texts) == expected


def _real_texts() -> list[str]:
    return [MIXED, held_out_text(20_000), "   \n\n\t x  ", "'s 've 'LL 12345678 ١٢٣"]


@pytest.mark.parametrize("name", ["gpt2", "cl100k_base", "o200k_base"])
def test_real_vocabularies_match_tiktoken(name, tmp_path):
    enc = tiktoken_encoding(name, tmp_path / "tiktoken-cache")
    if name == "gpt2":
        encoder, _ = gpt2_files()
        tok = lt.load(encoder)  # vocab.bpe is found next to encoder.json
        assert lt.load(encoder.parent).ranks == tok.ranks  # or the folder
    else:
        pattern = {"cl100k_base": "gpt4", "o200k_base": "o200k"}[name]
        tok = lt.load(tiktoken_gz(name), pattern=pattern, special_tokens=enc._special_tokens)
    assert tok.vocab_size == enc.n_vocab
    reference = tok.with_backend("reference")
    for text in _real_texts():
        expected = enc.encode(text, allowed_special="all")
        assert tok.encode(text, allowed_special="all") == expected
        assert reference.encode(text, allowed_special="all") == expected
        assert tok.decode(expected) == text
    endoftext = "<|endoftext|>"
    assert tok.encode(endoftext, allowed_special="all") == enc.encode(
        endoftext, allowed_special="all"
    )


def test_gpt2_merges_from_vocab_bpe_equal_derived_merges():
    encoder, _ = gpt2_files()
    tok = lt.load(encoder)
    from llmlab.tokenizer.bpe import derive_merges

    assert derive_merges(tok.ranks) == tok.merges
