"""Saved activation bytes and train-step time by precision and memory-reuse option, at several T.

Every case runs the same small GPT (2 layers, d=64, 4 heads, batch 2) for one optimizer step per
timing, in a plain PyTorch loop (the plugins' logic without Lightning's per-step overhead):

* fp32 (the reference of every row), fp16-master and bf16-master (``MasterWeights``: fp16/bf16
  model, fp32 masters; fp16 with a ``DynamicLossScaler``), bf16-mixed (``torch.autocast``),
  fp8 (``convert_to_float8``, emulated on CPU),
* checkpointing (every block), recompute-attention (``MemoryEfficientAttention``), and the
  explicit softmax(QKᵀ)V math attention whose T×T probabilities make saved bytes quadratic
  (PyTorch's CPU SDPA, the fp32 reference, is a fused kernel that does not store them).

Saved bytes come from ``saved_activation_bytes`` (saved-tensor hooks, parameters excluded).
On these CPUs fp16 has no native GEMM (~70× slower than fp32): its step-time ratio measures the
CPU, not the method. Run: ``python -m benchmarks.memory`` (``--smoke``: T=32 only, one timing).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import Row, best_of, parse_args, report
from llmlab.models import GPT, GPTConfig
from llmlab.parallel.memory import (
    apply_activation_checkpointing,
    saved_activation_bytes,
    use_math_attention,
    use_recompute_attention,
)
from llmlab.parallel.precision import DynamicLossScaler, MasterWeights, convert_to_float8

MODEL = dict(vocab_size=256, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
BATCH = 2
SEQ_LENS = (128, 256, 512)
CASES = ("fp16-master", "bf16-master", "bf16-mixed", "fp8", "checkpointing",
         "recompute-attention", "math-attention")  # fmt: skip


def build(case: str, T: int) -> tuple[GPT, Callable[[torch.Tensor, torch.Tensor], None], Any]:
    """The model for ``case`` and its one-step training function."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=T, **MODEL))
    context: Callable[[], Any] = contextlib.nullcontext
    masters = None
    if case == "fp16-master":
        model.half()
        masters = MasterWeights(model.parameters(), DynamicLossScaler(growth_interval=1000))
    elif case == "bf16-master":
        model.bfloat16()
        masters = MasterWeights(model.parameters())
    elif case == "bf16-mixed":
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif case == "fp8":
        convert_to_float8(model, min_features=64, backend="emulate")
    elif case == "checkpointing":
        apply_activation_checkpointing(model, every=1)
    elif case == "recompute-attention":
        use_recompute_attention(model)
    elif case == "math-attention":
        use_math_attention(model)
    elif case != "fp32":
        raise ValueError(f"unknown case {case!r}")
    params = masters.masters if masters is not None else list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with context():
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        if masters is None:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            masters.scale_loss(loss).backward()
            masters.step(opt, masters.unscale())

    return model, step, context


def measure(case: str, T: int, repeats: int = 2) -> tuple[int, float]:
    model, step, context = build(case, T)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, MODEL["vocab_size"], (BATCH, T), generator=g)
    y = torch.randint(0, MODEL["vocab_size"], (BATCH, T), generator=g)
    with context():
        saved = saved_activation_bytes(model, x).total_bytes
    seconds = best_of(lambda: step(x, y), repeats=repeats, warmup=1 if repeats > 1 else 0)
    return saved, seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    seq_lens, repeats = ((32,), 1) if args.smoke else (SEQ_LENS, 2)
    torch.set_num_threads(1)  # shared CPUs: OpenMP threads would spin waiting for each other
    rows: list[Row] = []
    notes = []
    for T in seq_lens:
        ref_bytes, ref_s = measure("fp32", T, repeats)
        notes.append(f"T={T}: fp32 saves {ref_bytes / 2**20:.2f} MiB, step {ref_s * 1e3:.1f} ms")
        for case in CASES:
            b, s = measure(case, T, repeats)
            rows.append(Row(f"saved MiB {case} T={T}", b / 2**20, ref_bytes / 2**20, "fp32",
                            "MiB", higher_is_better=False))  # fmt: skip
            rows.append(Row(f"step ms {case} T={T}", s * 1e3, ref_s * 1e3, "fp32", "ms",
                            higher_is_better=False))  # fmt: skip
    notes.append(
        "ratio > 1: fewer bytes / faster than fp32 (SDPA attention). fp16 on CPU has no native "
        "GEMM (~70x slower matmuls): its step time measures the CPU. math-attention is the "
        "explicit softmax(QK^T)V baseline whose T x T probabilities grow quadratically."
    )
    report("memory", rows, notes="\n".join(notes))


if __name__ == "__main__":
    main()
