"""Launch ``python -m llmlab.train`` as a user would, and read back what the run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a launcher tells a process about its place in a job. Inherited by a new job they are
# wrong: LOCAL_RANK makes Lightning believe its ranks were started externally (it waits for a
# rank 1 nobody starts), MASTER_PORT points at a store another process may still hold.
LAUNCH_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "NODE_RANK", "CROSS_RANK", "CROSS_SIZE",
)  # fmt: skip
QUICK = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def train_env(output_dir: Path, wandb_mode: str = "offline", **extra: str) -> dict[str, str]:
    # Inherited from the pytest worker, these would be wrong for a new job: WANDB_SERVICE (wandb
    # writes its service's address into a process that logged in-process; a child sharing it
    # keeps a killed child's run "in use" and refuses its resumption) and the launch variables
    # (left in the worker by an in-process fit with a distributed strategy).
    dropped = {"WANDB_SERVICE", *LAUNCH_VARIABLES}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLMLAB_RUN_", "TORCHELASTIC_")) and k not in dropped
    }
    env.update(
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
