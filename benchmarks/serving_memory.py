"""The serving engine's resident memory at a real size: one copy of the weights, in fewer bytes.

A Llama-3.2-1B-shaped model (random weights, fp32: 4.9 GB) is built in a fresh process that has
imported torch and ``llmlab.serving``; then the engine (``LLMEngine``) is built over it, with
weights as they are or ``quantize="int8"``, and serves 8 requests (32-token prompts, 16 new
tokens each). The process's resident set size (RSS, ``/proc/self/statm``) is read after the
imports, after the weights, after the engine (KV pool allocated, and quantized where asked), and
sampled every 10 ms while it serves; the peak is the largest sample.

Targets (issue 37): the peak stays within imports + weights + KV pool + 20 % of the weights (no
second copy of anything the size of the weights); with int8, the weights' resident share (RSS
after the engine, less the imports and the pool) is at most 0.35 of the fp32 weights' bytes.
What stays full precision in int8: the norms (and nothing else: the embedding and the tied LM
head share one int8 table).

Run: ``.venv/bin/python -m benchmarks.serving_memory`` (``--smoke``: a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from benchmarks.common import Row, parse_args, report

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(quantize: str | None, smoke: bool) -> dict[str, float]:
    """Run in a fresh process (``--child``): RSS at each stage, bytes in bytes."""
    import gc

    import torch

    import llmlab.serving  # noqa: F401  (the imports a server has)
    from llmlab.decoding import GenerationConfig
    from llmlab.models import Llama, LlamaConfig
    from llmlab.models.quantize import weight_bytes
    from llmlab.serving import EngineConfig, LLMEngine

    torch.set_num_threads(2)
    after_imports = rss()
    sizes = dict(vocab_size=128256, n_embd=2048, intermediate_size=8192, n_layer=16, n_head=32,
                 n_kv_head=8, block_size=2048, tie_embeddings=True)  # fmt: skip
    if smoke:
        sizes.update(vocab_size=512, n_embd=64, intermediate_size=128, n_layer=2, n_head=4,
                     n_kv_head=2)  # fmt: skip
    with torch.no_grad():
        model = Llama(LlamaConfig(**sizes)).eval()
    fp32_bytes = weight_bytes(model)
    gc.collect()
    after_weights = rss()
    config = EngineConfig(block_size=16, max_num_seqs=8, max_model_len=64, quantize=quantize)
    engine = LLMEngine(model, config=config)
    gc.collect()
    after_engine = rss()
    peak = [after_engine]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    g = torch.Generator().manual_seed(0)
    for i in range(8):
        prompt = torch.randint(0, sizes["vocab_size"], (32,), generator=g).tolist()
        engine.add_request(str(i), prompt, GenerationConfig(max_new_tokens=16))
    while engine.has_unfinished:
        engine.step()
    done.set()
    sampler.join()
    return {
        "after_imports": after_imports,
        "after_weights": after_weights,
        "after_engine": after_engine,
        "peak": max(peak[0], rss()),
        "pool": engine.runner.pool.nbytes,
        "fp32_weights": fp32_bytes,
        "weights": weight_bytes(model),
    }


def child_run(quantize: str | None, smoke: bool) -> dict[str, float]:
    args = [sys.executable, "-m", "benchmarks.serving_memory", "--child", quantize or "none"]
    out = subprocess.run(args + (["--smoke"] if smoke else []), check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help="(internal) measure one configuration in this process")
    if "--child" in sys.argv:
        parser.add_argument("--smoke", action="store_true")
        args = parser.parse_args()
        print(json.dumps(measure(None if args.child == "none" else args.child, args.smoke)))
        return
    args = parse_args(parser)
    fp32, int8 = child_run(None, args.smoke), child_run("int8", args.smoke)
    gib = 2**30
    bound = fp32["after_imports"] + fp32["fp32_weights"] * 1.2 + fp32["pool"]
    resident8 = int8["after_engine"] - int8["after_imports"] - int8["pool"]
    rows = [
        Row("fp32 engine: peak RSS while serving vs imports + weights + pool + 20 % weights",
            fp32["peak"] / gib, bound / gib, "the bound", "GiB", higher_is_better=False,
            target=None if args.smoke else 1.0),
        Row("int8 engine: weights' resident share vs 0.35 x fp32 weights", resident8 / gib,
            0.35 * int8["fp32_weights"] / gib, "0.35 x fp32 weights", "GiB",
            higher_is_better=False, target=None if args.smoke else 1.0),
        Row("int8 engine: peak RSS while serving vs the fp32 engine's", int8["peak"] / gib,
            fp32["peak"] / gib, "fp32 engine", "GiB", higher_is_better=False),
    ]  # fmt: skip
    notes = (
        f"fp32: imports {fp32['after_imports'] / gib:.2f} GiB, weights "
        f"{fp32['fp32_weights'] / gib:.2f} GiB (RSS after them "
        f"{fp32['after_weights'] / gib:.2f}), pool {fp32['pool'] / gib:.3f} GiB, after the engine "
        f"{fp32['after_engine'] / gib:.2f}, peak {fp32['peak'] / gib:.2f}. int8: weights "
        f"{int8['weights'] / gib:.2f} GiB by their tensors, resident {resident8 / gib:.2f} GiB "
        f"after quantizing (the fp32 weights freed), peak {int8['peak'] / gib:.2f} GiB (the fp32 "
        "model exists until quantize has converted it: a load straight into int8 is not built)."
    )
    report("serving_memory", rows, notes)


if __name__ == "__main__":
    main()
