"""The command line: train, encode and decode in real subprocesses."""

from __future__ import annotations

import subprocess
import sys

import pytest

import llmlab.tokenizer as lt
from tests.tokenizer.corpus import train_files


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmlab.tokenizer", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("model", "fmt", "vocab"),
    [
        ("bpe", "llmlab", 400),
        ("wordpiece", "hf", 300),
        ("unigram", "llmlab", 200),
        ("word_bpe", "vocab_merges", 300),
        ("sentencepiece_bpe", "sentencepiece", 500),
    ],
)
def test_train_encode_decode(tmp_path, model, fmt, vocab):
    text = train_files(0.01)[0].read_text(encoding="utf-8")[:40_000]
    (tmp_path / "a.txt").write_text(text[:20_000], encoding="utf-8")
    (tmp_path / "b.txt").write_text(text[20_000:], encoding="utf-8")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    out = tmp_path / "tok.json"
    done = _run("train", "--input", *files, "--vocab-size", str(vocab), "--model", model,
                "--out", str(out), "--format", fmt)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tok = lt.load(out)
    assert tok.model == model and tok.vocab_size == vocab

    text = "To be, or not to be"
    enc = _run("encode", "--tokenizer", str(out), "--text", text)
    assert enc.returncode == 0, enc.stderr
    ids = [int(x) for x in enc.stdout.split()]
    assert ids == tok.encode(text)
    dec = _run("decode", "--tokenizer", str(out), "--input", "-", stdin=enc.stdout)
    assert dec.returncode == 0, dec.stderr
    assert dec.stdout.rstrip("\n") == tok.decode(ids)


def test_clear_errors(tmp_path):
    bad = _run("train", "--input", str(tmp_path / "nope.txt"), "--vocab-size", "300",
               "--out", str(tmp_path / "x.json"))  # fmt: skip
    assert bad.returncode != 0 and "does not exist" in bad.stderr
    f = train_files(0.01)[0]
    small = _run(
        "train", "--input", str(f), "--vocab-size", "100", "--out", str(tmp_path / "x.json")
    )
    assert small.returncode == 2 and "too small" in small.stderr
    (tmp_path / "broken.json").write_text("{")
    broken = _run("encode", "--tokenizer", str(tmp_path / "broken.json"), "--text", "x")
    assert broken.returncode == 2 and "broken.json" in broken.stderr
