"""``make gpu-check``: everything worth running the first time llmlab meets a CUDA GPU.

1. every ``gpu``-marked test (``pytest -m gpu``: the compiled Triton kernels at GPU sizes);
2. ``python -m benchmarks.kernels`` (Triton vs cuBLAS / SDPA / eager / torch.compile);
3. a short run of the default experiment in each precision: fp32, bf16_mixed, bf16_master,
   fp16_master and fp8 (``torch._scaled_mm`` on GPUs with fp8 tensor cores, sm89+; emulated
   below that, and said so in the table);

then one summary table. Each step runs in its own process with a timeout, so one failure does
not hide the others; the budget is under 8 minutes on one GPU. On a machine without CUDA it says
so and exits 0 (nothing here can run on a CPU).

    python scripts/gpu_check.py [--steps N] [--only tests kernels train]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16_mixed", "bf16_master", "fp16_master", "fp8")
PARTS = ("tests", "kernels", "train")


@dataclass
class Outcome:
    step: str
    status: str
    seconds: float
    detail: str = ""


def run(step: str, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Outcome:
    """Run ``cmd`` from the repo root; its output streams through, its tail is kept."""
    print(f"\n[gpu-check] {step}: {' '.join(cmd)}", flush=True)
    start = time.time()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return Outcome(step, f"timed out after {timeout:.0f} s", time.time() - start)
    out = proc.stdout + proc.stderr
    print(out[-3000:], flush=True)
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    return Outcome(step, status, time.time() - start, _summary_line(step, out))


def _summary_line(step: str, out: str) -> str:
    if step == "gpu tests":
        found = re.findall(r"^=*\s*(\d+ passed.*?)\s*=*$", out, flags=re.M)
        return found[-1] if found else ""
    if step.startswith("train"):
        loss = re.findall(r"final val/loss ([0-9.]+)", out)
        return f"val loss {loss[-1]}" if loss else ""
    return ""


def fp8_backend() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return "scaled_mm" if (major, minor) >= (8, 9) else "emulate (GPU below sm89)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per precision")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); "
            "nothing to check. Run `make gpu-check` on a GPU machine."
        )
        return 0
    name = torch.cuda.get_device_name(0)
    print(f"gpu-check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    py = sys.executable
    outcomes: list[Outcome] = []
    if "tests" in args.only:
        outcomes.append(run("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu"], timeout=180))
    if "kernels" in args.only:
        outcomes.append(run("benchmarks.kernels", [py, "-m", "benchmarks.kernels"], timeout=150))
    if "train" in args.only:
        env = {
            "LLMLAB_OUTPUT_DIR": str(REPO / "outputs" / "gpu_check"),
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
        }
        common = [
            f"trainer.max_steps={args.steps}",
            f"trainer.val_check_interval={args.steps}",
            "trainer.limit_val_batches=4",
            "trainer.max_time=null",
            "trainer.enable_progress_bar=false",
        ]
        for precision in PRECISIONS:
            cmd = [py, "-m", "llmlab.train", f"precision={precision}", *common]
            outcome = run(f"train {precision}", cmd, timeout=60, env=env)
            if precision == "fp8":
                outcome.detail = f"{outcome.detail}; backend {fp8_backend()}".strip("; ")
            outcomes.append(outcome)

    print(f"\ngpu-check summary ({name})\n")
    print(f"| {'step':<20} | {'status':<24} | {'seconds':>7} | detail")
    print(f"|{'-' * 22}|{'-' * 26}|{'-' * 9}|--------")
    for o in outcomes:
        print(f"| {o.step:<20} | {o.status:<24} | {o.seconds:>7.0f} | {o.detail}")
    total = sum(o.seconds for o in outcomes)
    print(f"\ntotal {total / 60:.1f} min")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
