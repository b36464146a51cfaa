"""The merge loop's three ways of applying a merge learn the same merges: on arrays
(``merge_bulk.merge_many``, for merges rewriting ``BULK`` words or more), one word at a time
(``merge_trainer._merge_few``), and without numpy at all (the bare wheel: pure-Python initial
counts, every merge one word at a time). HF parity itself is tested in test_bpe_hf_parity.py,
test_word_bpe.py and test_sp_bpe.py; this checks the paths agree where the corpus sends every
merge down one of them."""

from __future__ import annotations

import pytest

import llmlab.tokenizer.merge_bulk as merge_bulk
import llmlab.tokenizer.merge_trainer as merge_trainer
from llmlab.tokenizer import BPETokenizer, WordBPETokenizer
from tests.tokenizer.corpus import train_files

pytest.importorskip("numpy")


def _train_both(files):
    byte_level = BPETokenizer.train_from_files(files, 1200, special_tokens=["<|endoftext|>"])
    words = WordBPETokenizer.train_from_files(files, 1200)
    return byte_level.merges, words.vocab, words.merges


@pytest.fixture(scope="module")
def files():
    return train_files(0.3)


def test_array_and_word_by_word_merges_agree(files, monkeypatch):
    default = _train_both(files)
    monkeypatch.setattr(merge_trainer, "BULK", 1)  # every merge on arrays
    assert _train_both(files) == default
    monkeypatch.setattr(merge_trainer, "BULK", 10**9)  # every merge one word at a time
    assert _train_both(files) == default


def test_without_numpy_the_merges_are_the_same(files, monkeypatch):
    default = _train_both(files)
    monkeypatch.setattr(merge_bulk, "np", None)
    assert _train_both(files) == default
