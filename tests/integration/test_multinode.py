"""Multi-node launching, tested on one machine: two "nodes" (two torchrun agents, node ranks 0
and 1, one process each) on 127.0.0.1 must train exactly like one node with two processes.

Oracle: the single-node 2-process DDP run of the same experiment (Lightning's own launcher).
Both runs do the same gloo all-reduce over the same ranks and shards, so the losses agree to
within 1e-5 (they are in fact bit-identical). The multi-node job shares one run directory and
W&B id through ``LLMLAB_RUN_DIR`` / ``LLMLAB_RUN_ID``, as ``scripts/slurm/train.sbatch`` does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmlab.parallel.launch import free_port
from tests.helpers.runs import REPO, run_train, train_env, wandb_history

pytestmark = pytest.mark.distributed

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.batch_size=8",
    "trainer.max_steps=20",
    "trainer.val_check_interval=20",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def _losses(run_dir: Path) -> dict[int, float]:
    history = wandb_history(
        run_dir / "wandb" / next((run_dir / "wandb").glob("offline-run-*")).name
    )
    return {int(h["trainer/global_step"]): h["train/loss"] for h in history if "train/loss" in h}


def _run_dir(out: Path, experiment: str) -> Path:
    return Path((out / experiment / "latest").read_text().strip())


def launch_two_nodes(out: Path, args: list[str], timeout: float = 600) -> Path:
    """Two torchrun agents (``--nnodes 2 --node-rank 0/1``) meeting at a c10d rendezvous."""
    run_id = "twonode1"
    run_dir = out / "gpt_ddp" / f"multinode-{run_id}"
    run_dir.mkdir(parents=True)
    (run_dir / "run_id").write_text(run_id + "\n")
    (out / "gpt_ddp" / "latest").write_text(str(run_dir.resolve()) + "\n")
    port = free_port()
    env = train_env(out, LLMLAB_RUN_DIR=str(run_dir.resolve()), LLMLAB_RUN_ID=run_id)
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", f"is_host={str(node_rank == 0).lower()}",
            "-m", "llmlab.train", *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for node_rank, (proc, text) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node_rank} failed:\n{text[-4000:]}"
    return run_dir


def _shared_cache(tmp_path: Path) -> str:
    """Tokenize + pack Shakespeare once per pytest session (basetemp), not once per run."""
    return f"paths.cache_dir={tmp_path.parent / 'llmlab-data-cache'}"


def test_two_nodes_on_localhost_equal_one_node_with_two_processes(tmp_path):
    single, cache = tmp_path / "single", _shared_cache(tmp_path)
    result = run_train(["experiment=gpt_ddp", *TINY, cache], single)
    assert result.returncode == 0, result.stderr[-4000:]
    reference = _losses(_run_dir(single, "gpt_ddp"))

    multi = tmp_path / "multi"
    run_dir = launch_two_nodes(
        multi, ["experiment=gpt_ddp", "trainer.devices=1", "trainer.num_nodes=2", *TINY, cache]
    )
    losses = _losses(run_dir)

    assert sorted(reference) == sorted(losses) == list(range(20))
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst <= 1e-5, f"two-node vs one-node max |Δloss| = {worst:.3g}"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_lightning_num_nodes_with_node_rank_env(tmp_path):
    """The launcher-free form: run the same command on every node with NODE_RANK, MASTER_ADDR
    and MASTER_PORT set; Lightning's own environment wires the ranks (devices × num_nodes)."""
    single, cache = tmp_path / "single", _shared_cache(tmp_path)
    assert run_train(["experiment=gpt_ddp", *TINY, cache], single).returncode == 0
    reference = _losses(_run_dir(single, "gpt_ddp"))

    out, run_id, port = tmp_path / "multi", "lnodes01", free_port()
    run_dir = out / "gpt_ddp" / f"multinode-{run_id}"
    run_dir.mkdir(parents=True)
    (run_dir / "run_id").write_text(run_id + "\n")
    procs = []
    for node_rank in (0, 1):
        env = train_env(
            out,
            LLMLAB_RUN_DIR=str(run_dir.resolve()),
            LLMLAB_RUN_ID=run_id,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NODE_RANK=str(node_rank),
        )
        cmd = [sys.executable, "-m", "llmlab.train", "experiment=gpt_ddp", "trainer.devices=1"]
        procs.append(
            subprocess.Popen(
                [*cmd, "trainer.num_nodes=2", *TINY, cache],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for node_rank, proc in enumerate(procs):
        text = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, f"node {node_rank} failed:\n{text[-4000:]}"
    losses = _losses(run_dir)
    assert max(abs(losses[s] - reference[s]) for s in reference) <= 1e-5
