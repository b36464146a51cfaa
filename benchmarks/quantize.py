"""Quantization error, judged by perplexity: the GPT that ``make train`` produces, in fp32 and in
every weight format of ``llmlab.models.quantize``, on held-out Shakespeare.

The products of a quantized layer compute ``x @ dequantize(W).T`` exactly (tested to 1e-4); what
quantization changes is the weights themselves, and the fair judge of that change is the loss
on text the model never saw. Steps:

1. ``python -m llmlab.train experiment=gpt_shakespeare`` (the default experiment: a byte-level
   GPT, 4 layers × 128) for ``STEPS`` steps, as ``make train`` runs it;
2. its checkpoint loaded as the server loads it (``llmlab.serving.loading.load``);
3. the validation works (every 16th file of the corpus, never trained on) as consecutive blocks
   of ``block_size`` tokens; mean negative log-likelihood per token, perplexity ``exp`` of it,
   for fp32 and each format (the same blocks, the same model, quantized copies).

Targets (issue 37): int8 within 1 % of fp32's perplexity, int4 (group 32) within 5 %.

Run: ``.venv/bin/python -m benchmarks.quantize`` (``--smoke``: a few steps, seconds).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Row, parse_args, report

STEPS = 1500
TARGETS = {"int8": 1 / 1.01, "int4": 1 / 1.05}  # fp32's perplexity / the format's, at least
FORMATS = ("bf16", "int8", "int4", "int4:g64", "int4:g128")


def train(steps: int, out: Path) -> Path:
    """Train the default experiment for ``steps`` steps; its last checkpoint."""
    env = {**os.environ, "LLMLAB_OUTPUT_DIR": str(out), "WANDB_MODE": "disabled",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    args = [f"trainer.max_steps={steps}", "trainer.max_time=null",
            "trainer.enable_progress_bar=false", f"trainer.val_check_interval={steps}",
            "trainer.limit_val_batches=1"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "llmlab.train", "experiment=gpt_shakespeare", *args],
                   env=env, check=True, capture_output=True)  # fmt: skip
    (ckpt,) = sorted(out.rglob("last.ckpt"))
    return ckpt


def held_out_blocks(tokenizer, block_size: int, limit: int) -> torch.Tensor:
    """The validation works as (N, block_size + 1) rows of consecutive token ids."""
    from llmlab.train.corpora import corpus_files

    ids: list[int] = []
    for path in corpus_files("shakespeare")["validation"]:
        ids += tokenizer.encode(Path(path).read_text(encoding="utf-8"))
    n = min(limit, (len(ids) - 1) // block_size)
    return torch.tensor(ids[: n * block_size + 1]).unfold(0, block_size + 1, block_size)


@torch.inference_mode()
def perplexity(model, blocks: torch.Tensor, batch: int = 16) -> float:
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch):
        rows = blocks[start : start + batch]
        logits = model(rows[:, :-1])
        total += float(
            F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        )
        count += rows[:, 1:].numel()
    return math.exp(total / count)


def main() -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    torch.set_num_threads(2)
    steps, limit = (3, 8) if args.smoke else (STEPS, 400)
    from llmlab.models import quantize
    from llmlab.serving.loading import load

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        loaded = load(train(steps, Path(tmp)))
        trained = time.perf_counter() - start
    model = loaded.model.eval()
    blocks = held_out_blocks(loaded.tokenizer, model.config.block_size, limit)
    base = perplexity(model, blocks)
    rows = []
    for scheme in FORMATS:
        ppl = perplexity(quantize(copy.deepcopy(model), scheme), blocks)
        target = TARGETS.get(scheme) if not args.smoke else None
        rows.append(Row(f"held-out perplexity: {scheme} vs fp32", ppl, base, "fp32",
                        "perplexity", higher_is_better=False, target=target))  # fmt: skip
    notes = (
        f"The default experiment's GPT ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters, byte-level) trained {steps} steps ({trained:.0f} s); {blocks.numel():,} "
        f"held-out tokens ({len(blocks)} blocks of {model.config.block_size}); fp32 perplexity "
        f"{base:.3f}."
    )
    report("quantize", rows, notes)


if __name__ == "__main__":
    main()
