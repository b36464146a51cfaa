"""The sampling CLI and the training callback, on a real (tiny) Lightning checkpoint.

A ``CausalLMTask`` with the byte tokenizer trains for 4 steps with ``SampleCallback`` attached
(samples after every 2nd validation run) and writes a checkpoint; then
``python -m llmlab.train.sample`` runs in a subprocess on it. Oracle for the CLI's text: the
same checkpoint loaded by hand and decoded greedily with ``llmlab.decoding.generate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from llmlab.decoding import generate  # noqa: E402
from llmlab.train.data import ByteTokenizer  # noqa: E402
from llmlab.train.sample import load_checkpoint  # noqa: E402
from llmlab.train.sample import main as sample_main  # noqa: E402
from llmlab.train.sample_callback import SampleCallback  # noqa: E402
from llmlab.train.task import CausalLMTask  # noqa: E402
from tests.helpers.tiny import quiet_trainer, romeo_loader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    loader = romeo_loader()
    task = CausalLMTask(
        model=dict(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32),
        warmup_steps=1,
        max_steps=4,
        tokenizer={"_target_": "llmlab.train.data.ByteTokenizer"},
    )
    callback = SampleCallback(prompts=["ROMEO:", "J"], every_n_val=2, max_new_tokens=8)
    trainer = quiet_trainer(
        max_steps=4,
        val_check_interval=1,
        limit_val_batches=1,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        callbacks=[callback],
    )
    trainer.fit(task, train_dataloaders=loader, val_dataloaders=loader)
    path = root / "last.ckpt"
    trainer.save_checkpoint(path)
    assert callback.val_runs == 4
    return path, root


def test_callback_logged_samples_every_second_validation(checkpoint):
    _, root = checkpoint
    log = (root / "samples.txt").read_text()
    assert log.count("=== step") == 4  # 2 logging rounds x 2 prompts
    assert "prompt 'ROMEO:'" in log and "prompt 'J'" in log


def test_sample_cli_prints_the_greedy_continuation(checkpoint):
    path, _ = checkpoint
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "llmlab.train.sample",
        f"ckpt={path}",
        "prompt=ROMEO:",
        "do_sample=false",
        "max_new_tokens=12",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    model, tok = load_checkpoint(str(path))
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("ROMEO:")
    expected = tok.decode(generate(model, torch.tensor([ids]), max_new_tokens=12)[0].tolist())
    assert out.stdout.rstrip("\n") == expected.rstrip("\n")


def test_sample_cli_rejects_bad_settings_before_work(checkpoint, capsys):
    path, _ = checkpoint
    assert sample_main([f"ckpt={path}", "prompt=R", "top_p=0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert sample_main([f"ckpt={path}", "prompt=R", "temprature=1"]) == 2
    assert "unknown setting 'temprature'" in capsys.readouterr().err
    args = [f"ckpt={path}", "prompt=R", "max_new_tokens=100", "sliding_window=null"]
    assert sample_main(args) == 2
    assert "block_size=32" in capsys.readouterr().err
    assert sample_main([f"ckpt={path}", "prompt=R", "sliding_window=64"]) == 2
    assert "sliding_window=64 exceeds the model's block_size=32" in capsys.readouterr().err
    assert sample_main(["ckpt=/nonexistent.ckpt"]) == 2


def test_sample_cli_slides_past_the_context_by_default(checkpoint, capsys):
    """100 new tokens from a block_size=32 model: the default sliding window keeps going, and
    the text equals nanoGPT's loop (crop to the last block_size tokens, full forward, argmax)."""
    path, _ = checkpoint
    assert (
        sample_main([f"ckpt={path}", "prompt=ROMEO:", "do_sample=false", "max_new_tokens=100"]) == 0
    )
    printed = capsys.readouterr().out.rstrip("\n")
    model, tok = load_checkpoint(str(path))
    seq = torch.tensor([tok.encode("ROMEO:")])
    with torch.no_grad():
        for _ in range(100):
            logits = model(seq[:, -32:])[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert printed == tok.decode(seq[0].tolist()).rstrip("\n")
