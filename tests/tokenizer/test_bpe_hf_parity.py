"""BPE against HF ``tokenizers``: training merge lists, and encoding both ways through
``tokenizer.json``. Default tests use up to ~0.6 MB of the corpus; the full 10 MB runs are
``slow``."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

import llmlab.tokenizer as lt
from llmlab.tokenizer import BPETokenizer
from llmlab.tokenizer.patterns import HF_BYTELEVEL_PATTERN
from tests.tokenizer.corpus import MIXED, held_out_text, train_files
from tests.tokenizer.hf_bpe import hf_bpe_trained, hf_merges

SPECIALS = ["<|endoftext|>", "<|pad|>"]


def _llmlab_pattern(pattern: str) -> str:
    return HF_BYTELEVEL_PATTERN if pattern == "hf-bytelevel" else pattern


@pytest.fixture(scope="module", params=["gpt4", "hf-bytelevel"])
def pair(request):
    """(pattern, llmlab tokenizer, HF tokenizer) trained on the same ~0.6 MB with vocab 2000."""
    files = train_files(0.6)
    ours = BPETokenizer.train_from_files(
        files, 2000, pattern=_llmlab_pattern(request.param), special_tokens=SPECIALS
    )
    theirs = hf_bpe_trained(files, 2000, request.param, SPECIALS)
    return request.param, ours, theirs


def _ours_as_strings(tok: BPETokenizer) -> list[tuple[str, str]]:
    return [(tok.id_to_token(a), tok.id_to_token(b)) for a, b in tok.merges]


def test_training_merge_list_equals_hf(pair):
    _, ours, theirs = pair
    merges = _ours_as_strings(ours)
    assert len(merges) == 2000 - 256 - len(SPECIALS)
    assert merges == hf_merges(theirs)
    assert ours.vocab_size == theirs.get_vocab_size() == 2000
    # identical vocabularies, id for id (specials first, then HF's byte alphabet order)
    assert {ours.id_to_token(i): i for i in range(2000)} == theirs.get_vocab()


def test_hf_trained_tokenizer_json_loads_and_encodes_like_hf(pair, tmp_path):
    _, _, theirs = pair
    theirs.save(str(tmp_path / "tokenizer.json"))
    loaded = lt.load(tmp_path / "tokenizer.json")
    assert isinstance(loaded, BPETokenizer)
    for text in (held_out_text(100_000), MIXED):
        expected = theirs.encode(text).ids
        assert loaded.encode(text) == expected
        assert loaded.with_backend("reference").encode(text) == expected
        assert loaded.decode(expected) == text


def test_llmlab_exported_tokenizer_json_encodes_like_llmlab_in_hf(pair, tmp_path):
    _, ours, _ = pair
    path = lt.save(ours, tmp_path / "tokenizer.json", format="hf")
    hf = Tokenizer.from_file(str(path))
    for text in (held_out_text(100_000), MIXED):
        assert hf.encode(text).ids == ours.encode(text)
    # special tokens: HF always extracts added tokens; llmlab does when allowed
    text = "to be<|endoftext|>or not<|pad|>"
    assert hf.encode(text).ids == ours.encode(text, allowed_special="all")
    assert hf.decode(ours.encode(MIXED), skip_special_tokens=False) == MIXED


def test_training_is_deterministic():
    files = train_files(0.3)
    a = BPETokenizer.train_from_files(files, 600, pattern="gpt2")
    b = BPETokenizer.train_from_files(files, 600, pattern="gpt2")
    assert a.merges == b.merges and a.ranks == b.ranks


def test_parallel_counting_gives_the_same_merges():
    files = train_files(0.15)
    one = BPETokenizer.train_from_files(files, 600, pattern="gpt4")
    two = BPETokenizer.train_from_files(files, 600, pattern="gpt4", workers=2)
    assert one.merges == two.merges


def test_min_frequency_stops_training_like_hf():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from llmlab.tokenizer.patterns import GPT4_PATTERN, to_onig

    files = train_files(0.15)
    ours = BPETokenizer.train_from_files(files, 5000, pattern="gpt4", min_frequency=40)
    theirs = Tokenizer(models.BPE())
    theirs.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(to_onig(GPT4_PATTERN)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=5000,
        min_frequency=40,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    theirs.train([str(f) for f in files], trainer)
    assert _ours_as_strings(ours) == hf_merges(theirs)
    assert ours.vocab_size < 5000


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [8192, 32768])
def test_training_parity_full_corpus(vocab_size):
    files = train_files(None)
    ours = BPETokenizer.train_from_files(files, vocab_size, pattern="gpt4", special_tokens=SPECIALS)
    theirs = hf_bpe_trained(files, vocab_size, "gpt4", SPECIALS)
    assert _ours_as_strings(ours) == hf_merges(theirs)
    text = held_out_text(None)
    assert ours.encode(text) == theirs.encode(text).ids
