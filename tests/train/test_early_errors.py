"""Mistakes end in one ``error:`` line before any process, run dir or W&B run exists; options
mean what their config comments say. Each runs ``python -m llmlab.train`` as a user would. (A
layout the world, the heads or the batch cannot take: tests/parallel/test_layout_errors.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import run_train

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=4",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_a_damaged_checkpoint_is_named_before_the_run_dir_exists(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_text("garbage\n")
    out = tmp_path / "out"
    line = assert_one_error_line(run_train([f"ckpt_path={bad}"], out), str(bad), "not a checkpoint")
    assert "weights_only" not in line
    assert not out.exists()


def test_a_truncated_last_checkpoint_is_named_before_the_resume_starts(tmp_path):
    """``ckpt_path=last`` with the ``last.ckpt`` a killed writer leaves: the previous run's dir
    gets no new W&B run and no new checkpoint."""
    run_dir = tmp_path / "gpt_shakespeare" / "20260101-000000-abcd1234"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "run_id").write_text("abcd1234\n")
    (tmp_path / "gpt_shakespeare" / "latest").write_text(f"{run_dir}\n")
    last = run_dir / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 5, "state_dict": {"w": torch.randn(128, 128)}}, last)
    last.write_bytes(last.read_bytes()[:40_000])
    result = run_train(["ckpt_path=last"], tmp_path)
    assert_one_error_line(result, f"ckpt_path=last: {last} is truncated or damaged")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "run_id"]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_val_check_interval_counts_optimizer_steps(tmp_path, shared_cache):
    """6 optimizer steps of 2 accumulated batches each, validating every 3 steps: 2 validations
    (at steps 3 and 6), where counting batches gave 4 (at batches 3, 6, 9, 12)."""
    args = [
        *TINY,
        "trainer.max_steps=6",
        "trainer.accumulate_grad_batches=2",
        "trainer.val_check_interval=3",
        f"paths.cache_dir={shared_cache}",
        "+callbacks.recorder._target_=tests.train.metric_recorder.MetricRecorder",
    ]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = tmp_path.glob("gpt_shakespeare/*/recorded_metrics.json")
    assert len(json.loads(record.read_text())["val_losses"]) == 2
    (last,) = tmp_path.glob("gpt_shakespeare/*/checkpoints/last.ckpt")
    assert torch.load(last, weights_only=False)["global_step"] == 6
    # The recipe's steps, logged as they happen.
    for step in ("tokenizer", "datamodule", "task", "logger", "trainer"):
        assert f"Instantiating {step} <" in result.stdout, result.stdout[-3000:]


def test_a_missing_or_unprepared_data_dir_after_a_good_run_leaves_latest_alone(tmp_path):
    """``data=tokens`` with a ``data.dir`` that is missing or not prepared, after a good run:
    refused in one line naming the dir, with no new run dir and ``latest`` (which
    ``ckpt_path=last`` resumes) still at the good run."""
    from llmlab.train.prepare import prepare

    docs = [
        f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(60)
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = tmp_path / "data"
    prepare([str(corpus)], data, val_fraction=0.2, progress=False)
    out = tmp_path / "out"
    quick = [*TINY, "trainer.max_steps=2", "trainer.val_check_interval=2"]
    good = run_train(["experiment=gpt_tokens", f"data.dir={data}", *quick], out)
    assert good.returncode == 0, good.stderr[-3000:]
    latest = out / "gpt_tokens" / "latest"
    (run_dir,) = [p for p in (out / "gpt_tokens").iterdir() if p.is_dir()]
    assert latest.read_text().strip() == str(run_dir.resolve())
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    unprepared = tmp_path / "unprepared"
    unprepared.mkdir()
    (unprepared / "notes.txt").write_text("raw text, never prepared\n")
    for bad, tokenizer in [
        (tmp_path / "missing", "tokenizer=prepared"),  # refused reading the tokenizer
        (unprepared, "tokenizer=byte"),  # refused building the data module
        (tmp_path / "missing", "tokenizer=byte"),
    ]:
        result = run_train(["experiment=gpt_tokens", f"data.dir={bad}", tokenizer, *quick], out)
        line = assert_one_error_line(result, f"{bad} is not a prepared token dataset")
        assert f"OUTPUT={bad}`" in line and "{root}" not in line
        assert [p for p in (out / "gpt_tokens").iterdir() if p.is_dir()] == [run_dir]
        assert latest.read_text().strip() == str(run_dir.resolve())
