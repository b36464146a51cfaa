"""Nothing is lost on failure: a killed run resumes from its last checkpoint, same W&B run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from tests.helpers.runs import REPO, run_train, train_env, wandb_history, wandb_records

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=4",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def test_killed_run_resumes_from_its_last_checkpoint_in_the_same_wandb_run(tmp_path):
    env = train_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmlab.train", "trainer.max_steps=100000", *TINY],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    exp_dir = tmp_path / "gpt_shakespeare"
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            ckpts = list(exp_dir.glob("*/checkpoints/last.ckpt"))
            if ckpts and torch.load(ckpts[0], weights_only=False)["global_step"] >= 6:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)  # no clean shutdown: as a crash or a pre-emption
    finally:
        proc.wait(timeout=60)
    (run_dir,) = [p for p in exp_dir.iterdir() if p.is_dir()]
    run_id = (run_dir / "run_id").read_text().strip()
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert step >= 6

    result = run_train(["ckpt_path=last", f"trainer.max_steps={step + 3}", *TINY], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p for p in exp_dir.iterdir() if p.is_dir()] == [run_dir]  # same run dir
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert final["global_step"] == step + 3

    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2  # the killed attempt and the resumed one ...
    assert all(w.name.endswith(run_id) for w in wandb_runs)  # ... under one W&B run id
    resumed = [h for h in wandb_history(wandb_runs[-1]) if "train/loss" in h]
    assert resumed[0]["trainer/global_step"] == step  # continues where the checkpoint left off


def test_offline_run_can_be_read_back_locally(tmp_path):
    result = run_train(["trainer.max_steps=3", *TINY], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (wandb_run,) = tmp_path.glob("gpt_shakespeare/*/wandb/offline-run-*")
    records = wandb_records(wandb_run)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_group"] == "gpt_shakespeare" and run["project"] == "llmlab"
    history = [h for h in wandb_history(wandb_run) if "train/loss" in h]
    assert [h["trainer/global_step"] for h in history] == [0, 1, 2]
    for key in ("train/tokens_per_sec", "train/mfu", "train/lr", "train/grad_norm"):
        assert all(key in h for h in history), key
    config_keys = set()
    for r in records:
        if r["type"] == "config":
            config_keys |= set(r["config"].get("update", {}))
    assert {"model", "data", "trainer", "experiment"} <= config_keys


def test_sharded_checkpoint_of_a_zero_run_resumes_from_the_app(tmp_path):
    """``strategy.sharded_checkpoints=true``: ``last.ckpt`` is a folder of per-rank shards, and
    ``ckpt_path=last`` resumes it (the resume check reads its index) in the same run and W&B
    run, with another ZeRO stage; the sampler reads the folder."""
    from llmlab.parallel.checkpoint import is_sharded, read_extra
    from llmlab.train.sample import load_checkpoint

    nd = ["experiment=gpt_ddp", "strategy=nd", "strategy.sharded_checkpoints=true", *TINY]
    result = run_train([*nd, "strategy.zero=1", "trainer.max_steps=3"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "gpt_ddp").iterdir() if p.is_dir()]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert is_sharded(last) and len(list(last.glob("*.distcp"))) == 2
    assert read_extra(last)["global_step"] == 3

    result = run_train([*nd, "strategy.zero=2", "ckpt_path=last", "trainer.max_steps=6"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p for p in (tmp_path / "gpt_ddp").iterdir() if p.is_dir()] == [run_dir]
    assert read_extra(last)["global_step"] == 6
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    resumed = [h for h in wandb_history(wandb_runs[-1]) if "train/loss" in h]
    assert resumed[0]["trainer/global_step"] == 3
    model, _ = load_checkpoint(str(last))
    assert sum(p.numel() for p in model.parameters()) > 0
