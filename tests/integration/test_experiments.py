"""Every experiment file trains for two steps, as `make train EXP=<name>` runs it.

Each run is a real subprocess (Lightning launches extra ranks by re-running the command line),
with W&B offline so that the test also checks there is exactly one W&B run per training run,
whatever the number of processes.
"""

from __future__ import annotations

import pytest

from tests.helpers.hf_tiny import experiment_user_files
from tests.helpers.runs import QUICK, REPO, run_train

# Experiments that read a prepared dataset run in their own test, which prepares it first.
OWN_TEST = {"gpt_tokens": "tests/integration/test_gpt_tokens.py"}
EXPERIMENTS = sorted(
    p.stem for p in (REPO / "experiments").glob("*.yaml") if p.stem not in OWN_TEST
)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One tokenized-data cache for all experiments (the Arrow files are reused, as in real use)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.distributed
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_two_steps_with_one_wandb_run(name, tmp_path, shared_cache):
    args = [f"experiment={name}", *QUICK, f"paths.cache_dir={shared_cache}"]
    result = run_train([*args, *experiment_user_files(name, tmp_path)], tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dirs = [p for p in (tmp_path / name).iterdir() if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    wandb_runs = list((run_dirs[0] / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1, f"expected one W&B run, found {wandb_runs}"
    assert (run_dirs[0] / "checkpoints" / "last.ckpt").exists()  # a directory under DeepSpeed
    # The recipe's steps are logged once, by rank zero, however many processes ran.
    assert result.stdout.count("Instantiating trainer <lightning.pytorch.Trainer>") == 1
