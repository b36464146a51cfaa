"""Launch ``python -m llmlab.train`` as a user would, and read back what the run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmlab.parallel.launch import free_port

REPO = Path(__file__).resolve().parents[2]
QUICK = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def train_env(output_dir: Path, wandb_mode: str = "offline", **extra: str) -> dict[str, str]:
    # WANDB_SERVICE: wandb writes its service's address into the environment of a process that
    # started one (a test that logged in-process); a child inheriting it would share that
    # service, which keeps a killed child's run "in use" and refuses its resumption.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("LLMLAB_RUN_") and k != "WANDB_SERVICE"
    }
    env.update(
        # A multi-process run's rendezvous port, chosen outside the ephemeral range (see
        # free_port): Lightning's own choice (bind(0)) races the gloo connections of other
        # test workers' runs and fails with EADDRINUSE under a parallel suite.
        MASTER_PORT=str(free_port()),
        LLMLAB_OUTPUT_DIR=str(output_dir),
        LLMLAB_EXPERIMENTS_DIR=str(REPO / "experiments"),
        WANDB_MODE=wandb_mode,
        WANDB_SILENT="true",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def run_train(
    args: list[str], output_dir: Path, timeout: float = 600, **env_extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmlab.train", *args],
        cwd=REPO,
        env=train_env(output_dir, **env_extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of an offline W&B run, through the wandb CLI (no network)."""
    wandb = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wandb_history(run_dir: Path) -> list[dict]:
    return [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
