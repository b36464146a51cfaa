"""WordPiece against HF's BertWordPieceTokenizer, given the same vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    BertWordPieceTokenizer,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

import llmlab.tokenizer as lt
from llmlab.tokenizer import WordPieceTokenizer
from tests.tokenizer.corpus import MIXED, code_files, held_out_text, train_files

EXTRA = "Crème brûlée, naïve FAÇADE! \x00ctrl\u200bzero-width \u3000ideographic space 東京 x" + (
    "a" * 120
)


@pytest.fixture(scope="module")
def hf() -> BertWordPieceTokenizer:
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train([str(f) for f in train_files(0.5)], vocab_size=3000, show_progress=False)
    return tok


@pytest.fixture(scope="module")
def ours_from_hf_vocab(hf) -> WordPieceTokenizer:
    return WordPieceTokenizer(hf.get_vocab())


def _texts() -> list[str]:
    return [held_out_text(60_000), MIXED, EXTRA]


def test_same_vocab_encodes_like_hf(hf, ours_from_hf_vocab):
    for text in _texts():
        assert ours_from_hf_vocab.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_decode_matches_hf(hf, ours_from_hf_vocab):
    ids = hf.encode(held_out_text(5000)).ids
    assert ours_from_hf_vocab.decode(ids) == hf.decode(ids)


def test_long_word_becomes_unk(ours_from_hf_vocab):
    unk = ours_from_hf_vocab.token_to_id("[UNK]")
    assert ours_from_hf_vocab.encode("a" * 101) == [unk]
    assert ours_from_hf_vocab.encode("a" * 100) != [unk]


def test_tokenizer_json_read_and_write(hf, ours_from_hf_vocab, tmp_path):
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = lt.load(tmp_path / "tokenizer.json")
    assert isinstance(loaded, WordPieceTokenizer)
    exported = Tokenizer.from_file(str(lt.save(ours_from_hf_vocab, tmp_path / "ours.json", "hf")))
    for text in _texts():
        expected = hf.encode(text, add_special_tokens=False).ids
        assert loaded.encode(text) == expected
        assert exported.encode(text, add_special_tokens=False).ids == expected
        with_specials = ours_from_hf_vocab.encode(text, add_special_tokens=True)
        assert exported.encode(text).ids == with_specials  # [CLS] ... [SEP]


def test_llmlab_training_and_hf_export(tmp_path):
    ours = WordPieceTokenizer.train_from_files(train_files(0.3), 1500)
    assert ours.vocab_size == 1500
    assert ours.token_to_id("[UNK]") == 1 and ours.id_to_token(0) == "[PAD]"
    assert any(t.startswith("##") for t in ours.vocab)
    hf = Tokenizer.from_file(str(lt.save(ours, tmp_path / "tokenizer.json", format="hf")))
    for text in _texts():
        assert hf.encode(text, add_special_tokens=False).ids == ours.encode(text)
    again = lt.load(lt.save(ours, tmp_path / "own.json"))
    assert again.encode(MIXED) == ours.encode(MIXED)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Cn excluded: Python's Unicode tables are older than Rust's, so unassigned-here characters
# (dropped as "control" by both) may be assigned letters in HF's tables.
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cn")), max_size=80))
def test_arbitrary_text_matches_hf(hf, ours_from_hf_vocab, text):
    assert ours_from_hf_vocab.encode(text) == hf.encode(text, add_special_tokens=False).ids


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPORA = {"shakespeare": lambda: train_files(0.25), "python-email": code_files}


def _hf_wordpiece_trained(files, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIALS, show_progress=False
    )
    tok.train([str(f) for f in files], trainer)
    return tok


@pytest.mark.parametrize("vocab_size", [1000, 3000])
@pytest.mark.parametrize("corpus", sorted(CORPORA))
def test_training_equals_hf_wordpiece_trainer_in_order(corpus, vocab_size):
    """HF's trainer numbers the ``##`` forms of the alphabet in a per-process random hash order
    (two HF runs differ); given the same initial layout, the whole vocabulary equals HF's id for
    id — which makes every merge and every tie-break the same."""
    files = CORPORA[corpus]()
    hf = _hf_wordpiece_trained(files, vocab_size)
    vocab = hf.get_vocab()
    layout = [t for t in sorted(vocab, key=vocab.get)[5:] if len(t.removeprefix("##")) == 1]
    ours = WordPieceTokenizer.train_from_files(files, vocab_size, initial_tokens=layout)
    assert ours.vocab == vocab  # every token at the same id
    text = held_out_text(20_000)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_vocab_size_too_small_fails_clearly():
    with pytest.raises(ValueError, match="vocab_size=10 is too small"):
        WordPieceTokenizer.train(["hello world"], 10)


def test_missing_unk_fails_clearly():
    with pytest.raises(ValueError, match="unk_token"):
        WordPieceTokenizer(["a", "b"])


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [8192, 32768])
def test_training_equals_hf_on_the_whole_corpus(vocab_size):
    files = train_files(None)
    hf = _hf_wordpiece_trained(files, vocab_size)
    vocab = hf.get_vocab()
    layout = [t for t in sorted(vocab, key=vocab.get)[5:] if len(t.removeprefix("##")) == 1]
    assert (
        WordPieceTokenizer.train_from_files(files, vocab_size, initial_tokens=layout).vocab == vocab
    )
