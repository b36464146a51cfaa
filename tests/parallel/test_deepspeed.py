"""DeepSpeed ZeRO on CPU through ``PortableDeepSpeedStrategy``, against Lightning's DDP.

Oracle: the same experiment trained with Lightning's ``DDPStrategy`` (gloo) on the same data
shards. ZeRO changes where optimizer state, gradients and parameters live, not the arithmetic,
so with fp32 the per-step losses agree within 1e-4 (the issue's bound; reduce-scatter vs
all-reduce sums in a different order, hence not bit-exact). The ZeRO checkpoint, consolidated to
a single-process state dict, must match DDP's weights (atol 1e-4) and decode like them.
Each run is a real ``python -m llmlab.train`` (2 processes), ZeRO and DDP launched together.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from llmlab.parallel.checkpoint.deepspeed_state import consolidated_state_dict
from llmlab.parallel.deepspeed import (
    DeepSpeedConfigError,
    PortableDeepSpeedStrategy,
    validate_deepspeed_settings,
)
from tests.helpers.runs import REPO, train_env, wandb_history

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.batch_size=8",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
]


def _launch(experiment: str, out: Path, steps: int, cache: Path) -> subprocess.Popen:
    args = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", *TINY]
    args.append(f"paths.cache_dir={cache}")  # tokenize + pack Shakespeare once per session
    return subprocess.Popen(
        [sys.executable, "-m", "llmlab.train", f"experiment={experiment}", *args],
        cwd=REPO,
        env=train_env(out, wandb_mode="offline"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def train_together(tmp: Path, experiments: list[str], steps: int) -> dict[str, Path]:
    """Train each experiment (concurrently) and return its run directory."""
    cache = tmp.parent / "llmlab-data-cache"  # pytest's basetemp: shared by the session
    procs = {e: _launch(e, tmp / e, steps, cache) for e in experiments}
    for name, proc in procs.items():
        text = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, f"{name} failed:\n{text[-5000:]}"
    return {e: Path((tmp / e / e / "latest").read_text().strip()) for e in experiments}


def _series(run_dir: Path, key: str = "train/loss") -> list[float]:
    wandb_dir = next((run_dir / "wandb").glob("offline-run-*"))
    rows = [h for h in wandb_history(wandb_dir) if key in h]
    return [h[key] for h in sorted(rows, key=lambda h: h["trainer/global_step"])]


def _flops_per_token(run_dir: Path, devices: int = 2) -> float:
    peak = _series(run_dir, "perf/peak_flops")[0]
    mfu, tps = _series(run_dir, "train/mfu")[-1], _series(run_dir, "train/tokens_per_sec")[-1]
    return mfu * peak * devices / tps


def _gpt(run_dir: Path, state_dict: dict[str, torch.Tensor]):
    from llmlab.models import GPT, GPTConfig

    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = GPT(GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True)))
    model.load_state_dict(state_dict)
    return model.eval()


def check_zero_against_ddp(runs: dict[str, Path], zero: str, steps: int) -> None:
    from llmlab.decoding import generate

    reference, losses = _series(runs["gpt_ddp"]), _series(runs[zero])
    assert len(reference) == len(losses) == steps
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    assert worst <= 1e-4, f"{zero} vs DDP: max |Δloss| = {worst:.3g} over {steps} steps"
    # telemetry: the engine's global (pre-clip) grad norm equals DDP's norm of the full grads
    norms, ddp_norms = (
        _series(runs[zero], "train/grad_norm"),
        _series(runs["gpt_ddp"], "train/grad_norm"),
    )
    assert len(norms) == steps
    for a, b in zip(norms, ddp_norms):
        assert abs(a - b) <= 1e-4 * max(1.0, b), (zero, norms, ddp_norms)

    # MFU counts the whole model's FLOPs/token, not the ZeRO-3 shard's (issue 15, defect 3):
    # recovered from the logs as fpt = mfu · peak · devices / tokens_per_sec, equal to DDP's
    assert _flops_per_token(runs[zero]) == pytest.approx(
        _flops_per_token(runs["gpt_ddp"]), rel=1e-5
    )

    ddp_ckpt = torch.load(runs["gpt_ddp"] / "checkpoints" / "last.ckpt", weights_only=False)
    ddp_state = {k[len("model.") :]: v for k, v in ddp_ckpt["state_dict"].items()}
    zero_ckpt = runs[zero] / "checkpoints" / "last.ckpt"
    assert zero_ckpt.is_dir()  # DeepSpeed's sharded layout
    state = consolidated_state_dict(zero_ckpt)
    assert sorted(state) == sorted(k for k in ddp_state if k in state)
    for key, value in state.items():
        torch.testing.assert_close(value, ddp_state[key], atol=1e-4, rtol=0, msg=key)

    zero_model, ddp_model = _gpt(runs[zero], state), _gpt(runs["gpt_ddp"], ddp_state)
    prompt = torch.tensor([list(b"ROMEO:")])
    out = generate(zero_model, prompt, max_new_tokens=12)
    assert out.shape == (1, 6 + 12)
    assert torch.equal(out, generate(ddp_model, prompt, max_new_tokens=12))


@pytest.mark.distributed
def test_zero2_matches_ddp_and_its_checkpoint_decodes(tmp_path):
    runs = train_together(tmp_path, ["gpt_ddp", "gpt_zero2"], steps=4)
    check_zero_against_ddp(runs, "gpt_zero2", steps=4)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_1_2_3_match_ddp_over_20_steps(tmp_path):
    """The issue's acceptance run: ZeRO-1/2/3 vs DDP, 20 steps, checkpoints decode."""
    zeros = ["gpt_zero1", "gpt_zero2", "gpt_zero3"]
    runs = train_together(tmp_path, ["gpt_ddp", *zeros], steps=20)
    for zero in zeros:
        check_zero_against_ddp(runs, zero, steps=20)


# --------------------------------------------------------------------------- no processes
def test_fp16_on_cpu_is_refused_before_any_process_starts():
    import lightning as L

    with pytest.raises(DeepSpeedConfigError, match=r"precision '16-mixed'.*bf16-mixed"):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=PortableDeepSpeedStrategy(stage=2),
            precision="16-mixed",
            logger=False,
        )


def test_bf16_on_cpu_is_accepted():
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PortableDeepSpeedStrategy(stage=3),
        precision="bf16-mixed",
        logger=False,
    )
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stage=4), r"strategy.stage=4: ZeRO stage must be one of \(0, 1, 2, 3\)"),
        (dict(offload_optimizer_device="gpu"), r"offload_optimizer_device='gpu'.*'cpu', 'nvme'"),
    ],
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        PortableDeepSpeedStrategy(**kwargs)


def test_offload_keeps_the_torch_optimizer():
    strategy = PortableDeepSpeedStrategy(stage=2, offload_optimizer=True)
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False


def test_validation_accepts_fp16_on_cuda():
    validate_deepspeed_settings(2, "16-mixed", on_cuda=True)


def test_shm_comm_op_is_not_built(monkeypatch):
    """DeepSpeed's comm backend asks ``__compatible_ops__`` before JIT-building the op."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from llmlab.parallel.deepspeed import SHM_COMM_OP, disable_shm_comm_op

    ops = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(ops, SHM_COMM_OP, ops.get(SHM_COMM_OP, True))
    disable_shm_comm_op()
    assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
    assert build_shm_op() is None  # returns at once instead of compiling for ~1 min
