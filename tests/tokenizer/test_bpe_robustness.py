"""Round trips on arbitrary text, save/load in every format, long runs, and clear errors."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmlab.tokenizer as lt
from llmlab.tokenizer import BPETokenizer, TokenizerFileError
from tests.tokenizer.corpus import MIXED, train_files


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer.train_from_files(
        train_files(0.3), 800, pattern="gpt4", special_tokens=["<|endoftext|>"]
    )


SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(text=st.text(max_size=200))
def test_decode_encode_roundtrip_arbitrary_unicode(tok, text):
    ids = tok.encode(text, disallowed_special=())
    assert tok.decode(ids) == text
    assert tok.with_backend("reference").encode(text, disallowed_special=()) == ids


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from("ab \n\t'1é日"), max_size=300))
def test_reference_equals_fast_on_adversarial_alphabet(tok, text):
    assert tok.with_backend("reference").encode(text) == tok.encode(text)


@pytest.mark.parametrize("fmt", ["llmlab", "hf", "tiktoken"])
def test_save_load_gives_identical_encodings(tok, tmp_path, fmt):
    path = lt.save(tok, tmp_path / f"tok.{fmt}", format=fmt)
    options = {"pattern": "gpt4", "special_tokens": tok.special_tokens} if fmt == "tiktoken" else {}
    again = lt.load(path, **options)
    assert again.ranks == tok.ranks and again.special_tokens == tok.special_tokens
    assert again.encode(MIXED) == tok.encode(MIXED)
    if fmt != "tiktoken":
        assert again.merges == tok.merges


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=100))
def test_save_load_roundtrip_property(tok, tmp_path, text):
    path = tmp_path / "tok.json"
    if not path.exists():
        lt.save(tok, path)
    assert lt.load(path).encode(text, disallowed_special=()) == tok.encode(
        text, disallowed_special=()
    )


def test_own_format_is_human_readable(tok, tmp_path):
    data = json.loads(lt.save(tok, tmp_path / "tok.json").read_text(encoding="utf-8"))
    assert data["format"] == "llmlab-tokenizer" and data["model"] == "bpe"
    assert data["vocab"]["Ġthe"] == tok.token_to_id(b" the")
    assert all(" " in m for m in data["merges"])


@pytest.mark.parametrize("backend", ["tiktoken", "reference"])
def test_long_run_of_one_character_is_not_quadratic(tok, backend):
    enc = tok.with_backend(backend)

    def seconds(n: int) -> float:
        """The best of two encodes, in this process's CPU time: the wall clock also counts the
        time other processes hold the core (a full suite runs beside this test)."""
        text = "a" * n
        best = math.inf
        for _ in range(2):
            start = time.process_time()
            ids = enc.encode(text)
            best = min(best, time.process_time() - start)
        assert enc.decode(ids) == text
        return best

    small, large = seconds(250_000), seconds(1_000_000)
    # 4x the input: linear is ~4x the time, quadratic ~16x. Allow noise on a shared machine.
    assert large < 9 * small + 0.5, (small, large)
    assert large < 30


def test_vocab_size_below_bytes_plus_specials_fails_clearly():
    with pytest.raises(ValueError, match=r"at least 258 ids \(256 bytes \+ 2 special"):
        BPETokenizer.train(["abc"], 257, special_tokens=["<a>", "<b>"])


def test_unknown_pattern_name_fails_clearly():
    with pytest.raises(ValueError, match=r"unknown pre-tokenization pattern name 'gpt5'.*gpt4"):
        BPETokenizer.train(["abc"], 300, pattern="gpt5")


def test_bad_regex_fails_clearly():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        BPETokenizer.train(["abc"], 300, pattern="([a-z")


def test_custom_regex_pattern_trains_and_encodes():
    tok = BPETokenizer.train(["hello world " * 50], 270, pattern=r"\S+|\s+")
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.encode("hello") == [tok.token_to_id(b"hello")]


def test_unknown_id_in_decode_fails_clearly(tok):
    with pytest.raises(ValueError, match="token id 99999 is not in this vocabulary"):
        tok.decode([99999])


def test_damaged_files_name_the_file_and_problem(tok, tmp_path):
    bad_json = tmp_path / "broken.json"
    bad_json.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerFileError, match=r"broken\.json: damaged JSON"):
        lt.load(bad_json)

    bad_ranks = tmp_path / "bad.tiktoken"
    bad_ranks.write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(TokenizerFileError, match=r"bad\.tiktoken: line 2"):
        lt.load(bad_ranks, pattern="gpt4")

    good = lt.save(tok, tmp_path / "ok.tiktoken", format="tiktoken")
    with pytest.raises(TokenizerFileError, match="pass pattern="):
        lt.load(good)

    hf = json.loads(lt.save(tok, tmp_path / "tokenizer.json", format="hf").read_text())
    hf["model"]["type"] = "WordLevel"
    (tmp_path / "wl.json").write_text(json.dumps(hf))
    with pytest.raises(
        TokenizerFileError, match=r"wl\.json: model type 'WordLevel' is not supported"
    ):
        lt.load(tmp_path / "wl.json")

    own = json.loads(lt.save(tok, tmp_path / "own.json").read_text())
    own["version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(own))
    with pytest.raises(TokenizerFileError, match="version 99 is not supported"):
        lt.load(tmp_path / "v99.json")

    with pytest.raises(TokenizerFileError, match="no such file"):
        lt.load(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(TokenizerFileError, match="empty"):
        lt.load(tmp_path / "empty.json")


def test_missing_bytes_fail_clearly():
    with pytest.raises(ValueError, match="all 256 single bytes"):
        BPETokenizer({b"a": 0}, pattern="gpt2")


def test_vocabulary_accessors(tok):
    the = tok.token_to_id(b" the")
    assert the is not None and tok.id_to_token(the) == "Ġthe" and tok.token_to_id("Ġthe") == the
    assert tok.token_to_id("<|endoftext|>") == tok.eos_token_id == 0
    assert tok.id_to_token(0) == "<|endoftext|>"
    assert tok.vocab_size == 800
    assert tok.token_to_id("not a token at all") is None
