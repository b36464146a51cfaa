"""The merge loop's ways of applying a merge learn the same merges: the compiled loop
(``_merge_core.c``, the default where it was built), and in Python on arrays
(``merge_bulk.merge_many``, for merges rewriting ``BULK`` words or more), one word at a time
(``merge_trainer._merge_few``), and without numpy at all (the bare wheel: pure-Python initial
counts, every merge one word at a time). HF parity itself is tested in test_bpe_hf_parity.py,
test_word_bpe.py and test_sp_bpe.py (on the default path); this checks the paths agree, on
Shakespeare and on random corpora over small alphabets whose vocabulary starts with a few
longer tokens, so that merges re-make a token that exists already (as a merge re-makes a special
or control token spelled in the text: the words holding the new token are then recounted whole),
and words repeat one symbol ("aaaa")."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

import llmlab.tokenizer.merge_bulk as merge_bulk
import llmlab.tokenizer.merge_trainer as merge_trainer
from llmlab.tokenizer import BPETokenizer, WordBPETokenizer
from tests.tokenizer.corpus import EXISTING, learn_merges, random_merge_corpus, train_files

pytest.importorskip("numpy")
compiled = pytest.mark.skipif(
    merge_trainer._merge_core is None,
    reason="llmlab.tokenizer._merge_core was not built (no C compiler at install time)",
)


def _train_both(files):
    byte_level = BPETokenizer.train_from_files(files, 1200, special_tokens=["<|endoftext|>"])
    words = WordBPETokenizer.train_from_files(files, 1200)
    return byte_level.merges, words.vocab, words.merges


def _python_paths(monkeypatch):
    """Each Python way of applying merges, in turn (the compiled core switched off)."""
    monkeypatch.setattr(merge_trainer, "_merge_core", None)
    for bulk, numpy in (
        (30, merge_bulk.np),
        (1, merge_bulk.np),
        (10**9, merge_bulk.np),
        (30, None),
    ):
        monkeypatch.setattr(merge_trainer, "BULK", bulk)  # 1: every merge on arrays
        monkeypatch.setattr(merge_bulk, "np", numpy)
        yield f"BULK={bulk}, numpy={numpy is not None}"


@pytest.fixture(scope="module")
def files():
    return train_files(0.3)


def test_every_merge_path_agrees_on_shakespeare(files, monkeypatch):
    default = _train_both(files)
    for path in _python_paths(monkeypatch):
        assert _train_both(files) == default, path


@compiled
@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_loop_learns_what_the_python_loop_learns(seed, monkeypatch):
    rng = random.Random(seed)
    words, counts = random_merge_corpus(rng)
    vocab_size, min_frequency = rng.randint(10, 400), rng.choice((0, 0, 2, 20))
    expected = learn_merges(words, counts, vocab_size, min_frequency)
    assert len(expected[0]) > 3
    for path in _python_paths(monkeypatch):
        assert learn_merges(words, counts, vocab_size, min_frequency) == expected, path


@compiled
def test_the_corpus_exercises_re_made_tokens(monkeypatch):
    """The random corpora above do reach the "merge re-makes an existing token" branch."""
    reused = 0
    for seed in range(12):
        words, counts = random_merge_corpus(random.Random(seed))
        merges, tokens = learn_merges(words, counts, 400, 0)
        reused += len(merges) - (len(tokens) - len(set("".join(words))) - len(EXISTING))
    assert reused >= 12


@compiled
def test_the_compiled_loop_rejects_bad_input_by_name():
    core = merge_trainer._merge_core
    with pytest.raises(ValueError, match="counts must be a list as long as words"):
        core.train(["ab"], [1, 2], 2, 10, 0, lambda a, b: 2)
    with pytest.raises(TypeError, match=r"words\[1\] must be a str"):
        core.train(["ab", 3], [1, 1], 2, 10, 0, lambda a, b: 2)
    with pytest.raises(ValueError, match=r"new_token returned id 7; expected 0\.\.2"):
        core.train(["ab"], [1], 2, 10, 0, lambda a, b: 7)
    with pytest.raises(ZeroDivisionError):  # an error in the callback propagates
        core.train(["ab"], [1], 2, 10, 0, lambda a, b: 1 // 0)


def test_llmlab_tokenizer_pure_switches_the_compiled_loop_off():
    probe = "import llmlab.tokenizer.merge_trainer as m; print(m._merge_core is None)"
    env = {**os.environ, "LLMLAB_TOKENIZER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
