"""Training throughput: tokens/s of one training step, llmlab against the alternatives.

The default experiment's step (GPT 4 layers x 128, 4 heads, vocab 256, context 128, global batch
32, fp32; forward, cross-entropy, backward, clip at 1.0, AdamW, LR schedule) measured five ways
in one process:

  (a) llmlab ``GPT`` in a raw PyTorch loop;
  (b) the Lightning path that ``make train`` runs (``llmlab.train.app.train``: the data module,
      callbacks, telemetry, W&B offline logger and progress bar as configured);
  (c) (b) with ``compile=true`` (compile time reported separately, from dynamo's timers);
  (d) litgpt's ``GPT`` of the same shape in the same raw loop (``parallel_residual=False``,
      LayerNorm, GELU-tanh MLP, tied embeddings: GPT-2's layout; RoPE on 25 % of each head,
      litgpt's default, where llmlab has learned positions);
  (e) HF ``GPT2LMHeadModel`` of the same shape (SDPA attention) in the same raw loop.

Timing: per-step CPU time of this process (``time.process_time`` between consecutive step ends,
so the Lightning path pays for its data loading, logging, callbacks and progress-bar thread) on
``--threads`` torch threads (default 1). On this shared 2-core machine other jobs make wall time
swing by 3x within a minute (measured); CPU time on one thread counts the work done, and on an
idle machine it equals wall time. The first ``--warmup`` steps are dropped; the figure is the
best mean over windows of ``--window`` consecutive steps (best of several). The raw loops run in
interleaved rounds, half before and half after the Lightning runs. Also: the AdamW implementations
(``task.optimizer_impl``) and the default experiment's MFU against the measured matmul peak.

Run: ``.venv/bin/python -m benchmarks.train`` (``--smoke``: a 1-layer model of width 32, a
few steps, no compilation; ``--profile`` to
print where the time goes in each raw loop and in the compiled step).
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common import STEP_TIMES, Row, parse_args, report

CLOCK = time.process_time  # see the module docstring

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """The model and batch every row measures (the default experiment's, vocab: bytes)."""

    vocab: int = 256
    block: int = 128
    layers: int = 4
    heads: int = 4
    embd: int = 128
    batch: int = 32


DEFAULT_SHAPE, SMOKE_SHAPE = Shape(), Shape(block=32, layers=1, heads=2, embd=32, batch=4)
SHAPE = DEFAULT_SHAPE  # main() sets SMOKE_SHAPE for --smoke
HP = SimpleNamespace(  # conf/task/causal_lm.yaml's
    lr=2e-3,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    eps=1e-8,
    warmup_steps=100,
    max_steps=1100,
    min_lr_ratio=0.1,
    get=lambda key, default=None: getattr(HP, key, default),
)


# ----------------------------------------------------------------------------- models
def gpt_config() -> Any:
    """llmlab's ``GPTConfig`` of ``SHAPE``."""
    from llmlab.models import GPTConfig

    return GPTConfig(vocab_size=SHAPE.vocab, block_size=SHAPE.block, n_layer=SHAPE.layers,
                     n_head=SHAPE.heads, n_embd=SHAPE.embd)  # fmt: skip


def llmlab_gpt() -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    from llmlab.models import GPT

    model = GPT(gpt_config())
    return model, model


def llmlab_gpt_compiled() -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    """(a) with ``compile_blocks``: what ``compile=true`` does, without Lightning around it."""
    from llmlab.parallel.compile import compile_blocks

    model, forward = llmlab_gpt()
    compile_blocks(model)
    return model, forward


def litgpt_gpt() -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as err:
        raise SystemExit(
            f"litgpt does not import ({err}); `make install` installs litgpt==0.5.13 --no-deps"
        ) from err

    config = Config(
        name="llmlab-default-shape",
        block_size=SHAPE.block,
        vocab_size=SHAPE.vocab,
        padded_vocab_size=SHAPE.vocab,
        n_layer=SHAPE.layers,
        n_head=SHAPE.heads,
        n_embd=SHAPE.embd,
        bias=True,
        parallel_residual=False,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        intermediate_size=4 * SHAPE.embd,
        gelu_approximate="tanh",
    )
    model = GPT(config)
    model.lm_head.weight = model.transformer.wte.weight  # tied, as GPT-2 and llmlab
    return model, model


def hf_gpt2() -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=SHAPE.vocab,
        n_positions=SHAPE.block,
        n_embd=SHAPE.embd,
        n_layer=SHAPE.layers,
        n_head=SHAPE.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    return model, lambda x: model(input_ids=x, use_cache=False).logits


# ----------------------------------------------------------------------------- raw loop
class RawLoop:
    """forward → cross-entropy → backward → clip 1.0 → AdamW (foreach) → LR step, by hand."""

    def __init__(
        self, name: str, build: Callable[[], tuple[nn.Module, Callable]], compile: bool = False
    ) -> None:
        from llmlab.parallel.compile import compile_loss
        from llmlab.train.task import adamw_warmup_cosine, causal_lm_loss

        torch.manual_seed(0)
        self.name = name
        self.model, self.forward = build()
        self.model.train()
        opt = adamw_warmup_cosine(self.model, HP)
        self.optimizer, self.scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
        g = torch.Generator().manual_seed(0)
        shape = (SHAPE.batch, SHAPE.block + 1)
        self.batches = [torch.randint(0, SHAPE.vocab, shape, generator=g) for _ in range(4)]
        self.loss_fn = compile_loss(causal_lm_loss) if compile else causal_lm_loss
        self.times: list[float] = []
        self.params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def step(self) -> None:
        batch = self.batches[len(self.times) % len(self.batches)]
        start = CLOCK()
        loss = self.loss_fn(self.forward(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(CLOCK() - start)


def best_window(times: list[float], warmup: int, window: int) -> float:
    """Best mean step time over windows of ``window`` consecutive steps after ``warmup``."""
    kept = times[warmup:]
    if len(kept) < window:
        raise ValueError(f"only {len(kept)} timed steps for a window of {window}")
    return min(sum(kept[i : i + window]) / window for i in range(0, len(kept) - window + 1))


# ------------------------------------------------------------------------ Lightning path
def _step_timer_class() -> type:
    import lightning as L

    class StepTimer(L.Callback):
        """Appends the clock's time at each training step's end to ``STEP_TIMES``."""

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            STEP_TIMES.append(CLOCK())

    return StepTimer


def StepTimer() -> Any:
    """A Hydra ``_target_``: the callback, built only when Lightning is imported anyway."""
    return _step_timer_class()()


def lightning_step_times(steps: int, compile: bool, output_dir: str) -> tuple[list[float], float]:
    """Per-step times of ``make train``'s path for ``steps`` steps; and compile seconds."""
    import wandb
    from torch._dynamo.utils import calculate_time_spent

    from llmlab.train.app import compose_config, train

    os.environ.update(LLMLAB_OUTPUT_DIR=output_dir, WANDB_MODE="offline", WANDB_SILENT="true")
    for key in ("LLMLAB_RUN_DIR", "LLMLAB_RUN_ID"):
        os.environ.pop(key, None)
    cfg = compose_config(
        [
            f"compile={str(compile).lower()}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",  # one validation, after the timed steps
            *(
                f"model.{key}={value}"
                for key, value in (
                    ("block_size", SHAPE.block),
                    ("n_layer", SHAPE.layers),
                    ("n_head", SHAPE.heads),
                    ("n_embd", SHAPE.embd),
                )
            ),
            f"data.batch_size={SHAPE.batch}",
            "trainer.limit_val_batches=1",
            "trainer.max_time=null",
            "+callbacks.step_timer._target_=benchmarks.train.StepTimer",
            f"paths.cache_dir={REPO / 'outputs' / 'cache'}",  # the tokenized corpus, reused
        ]
    )
    STEP_TIMES.clear()
    before = calculate_time_spent().get("total_wall_time", 0.0)
    train(cfg)
    wandb.finish()  # the next run in this process gets its own W&B run
    compile_seconds = calculate_time_spent().get("total_wall_time", 0.0) - before
    ends = list(STEP_TIMES)
    return [b - a for a, b in itertools.pairwise(ends)], compile_seconds


# ----------------------------------------------------------------------------- optimizer
def optimizer_rows(repeats: int) -> list[Row]:
    """AdamW step time per implementation on the default model, and distance from the loop."""
    from llmlab.models import GPT
    from llmlab.train.task import OPTIMIZER_IMPLS, adamw, param_groups

    torch.manual_seed(0)
    base = GPT(gpt_config())
    grads = [torch.randn_like(p) * 1e-2 for p in base.parameters()]
    models, opts, times = {}, {}, {impl: [] for impl in OPTIMIZER_IMPLS}
    for impl in OPTIMIZER_IMPLS:
        models[impl] = GPT(base.config)
        models[impl].load_state_dict(base.state_dict())
        opts[impl] = adamw(param_groups(models[impl], 0.1), impl, lr=2e-3, betas=(0.9, 0.95))
    for _ in range(repeats):
        for impl in OPTIMIZER_IMPLS:  # interleaved: load drifts hit all three
            for p, g in zip(models[impl].parameters(), grads):
                p.grad = g.clone()
            start = CLOCK()
            opts[impl].step()
            times[impl].append(CLOCK() - start)
    ref = dict(models["default"].named_parameters())
    rows = []
    for impl in ("foreach", "fused"):
        diff = max((p - ref[n]).abs().max().item() for n, p in models[impl].named_parameters())
        rows.append(
            Row(
                name=f"AdamW step, optimizer_impl={impl}",
                llmlab=min(times[impl][2:]) * 1e3,
                reference=min(times["default"][2:]) * 1e3,
                reference_name="optimizer_impl=default (for-loop)",
                unit="ms",
                higher_is_better=False,
                extra={"max_abs_param_diff_vs_default": diff, "steps": repeats},
            )
        )
    return rows


# ----------------------------------------------------------------------------- profile
def profile_loop(loop: RawLoop, steps: int = 3) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loop.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    global SHAPE
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6, help="raw-loop rounds (even)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true")
    args = parse_args(parser, argv)
    if args.smoke:
        args.warmup, args.window, args.rounds = 1, 1, 2
        SHAPE = SMOKE_SHAPE
    torch.set_float32_matmul_precision("high")  # what the app sets: the same for every row
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    tokens = SHAPE.batch * SHAPE.block

    loops = [RawLoop("llmlab", llmlab_gpt), RawLoop("litgpt", litgpt_gpt), RawLoop("hf", hf_gpt2)]
    raw_compile_s = 0.0
    if not args.smoke:
        loops.append(RawLoop("compiled", llmlab_gpt_compiled, compile=True))
    from torch._dynamo.utils import calculate_time_spent

    for loop in loops:
        before = calculate_time_spent().get("total_wall_time", 0.0)
        for _ in range(args.warmup):
            loop.step()
        if loop.name == "compiled":
            raw_compile_s = calculate_time_spent().get("total_wall_time", 0.0) - before

    def raw_rounds(n: int) -> None:
        for _ in range(n):
            for loop in loops:
                for _ in range(args.window):
                    loop.step()

    raw_rounds(args.rounds // 2)
    lightning_steps = args.warmup + args.window * args.rounds
    with tempfile.TemporaryDirectory(prefix="llmlab-bench-train-") as out:
        eager_times, _ = lightning_step_times(lightning_steps, False, out)
        compiled_times, compile_s = (
            ([], 0.0) if args.smoke else lightning_step_times(lightning_steps, True, out)
        )
    raw_rounds(args.rounds - args.rounds // 2)

    tps = {loop.name: tokens / best_window(loop.times, args.warmup, args.window) for loop in loops}
    tps["lightning"] = tokens / best_window(eager_times, args.warmup, args.window)
    if compiled_times:
        tps["lightning compiled"] = tokens / best_window(compiled_times, args.warmup, args.window)
    for name, value in tps.items():
        print(f"  {name:<18} {value:8.0f} tokens/s")

    unit = "tokens/s"
    rows = [
        Row("(b) Lightning path / (a) raw loop", tps["lightning"], tps["llmlab"],
            "llmlab raw loop", unit, target=0.95),
        Row("(a) llmlab raw loop / (d) litgpt", tps["llmlab"], tps["litgpt"],
            "litgpt GPT, same loop", unit, target=1.0),
        Row("(a) llmlab raw loop / (e) HF GPT-2", tps["llmlab"], tps["hf"],
            "HF GPT2LMHeadModel, same loop", unit, target=1.0),
        Row("(b) Lightning path / (d) litgpt", tps["lightning"], tps["litgpt"],
            "litgpt GPT, raw loop", unit),
        Row("(b) Lightning path / (e) HF GPT-2", tps["lightning"], tps["hf"],
            "HF GPT2LMHeadModel, raw loop", unit),
    ]  # fmt: skip
    if compiled_times:
        rows += [
            Row("(c) compile=true / (b) eager Lightning", tps["lightning compiled"],
                tps["lightning"], "eager Lightning path", unit, target=1.2,
                extra={"compile_seconds": compile_s}),
            Row("raw loop with compile_blocks + compile_loss / (a)", tps["compiled"],
                tps["llmlab"], "llmlab raw loop", unit,
                extra={"compile_seconds": raw_compile_s}),
        ]  # fmt: skip

    from llmlab.models import GPT
    from llmlab.train.telemetry import cached_cpu_peak_flops

    with torch.device("meta"):
        fpt = GPT(gpt_config()).flops_per_token()
    peak = cached_cpu_peak_flops()
    achieved = tps["lightning"] * fpt
    rows.append(
        Row(
            "MFU of the default experiment (Lightning path)",
            achieved / 1e9,
            peak / 1e9,
            "best fp32 matmul rate measured here",
            "GFLOP/s",
            extra={"mfu": achieved / peak, "flops_per_token": fpt},
        )
    )
    rows += optimizer_rows(repeats=3 if args.smoke else 40)
    fused = rows[-1].extra["max_abs_param_diff_vs_default"]
    foreach = rows[-2].extra["max_abs_param_diff_vs_default"]

    params = {loop.name: loop.params for loop in loops}
    notes = (
        f"Default experiment's step: GPT {SHAPE.layers}x{SHAPE.embd}, {SHAPE.heads} heads, "
        f"vocab {SHAPE.vocab}, context {SHAPE.block}, batch {SHAPE.batch} ({tokens} tokens), "
        f"fp32, {threads} torch thread(s), timed in "
        "CPU seconds of the process, "
        f"AdamW foreach + clip 1.0 + LR schedule. Best mean over windows of {args.window} steps "
        f"after {args.warmup} warm-up steps; raw loops in {args.rounds} interleaved rounds. "
        f"Parameters: llmlab {params['llmlab']:,}, litgpt {params['litgpt']:,} (no position "
        f"table; RoPE on 25 % of each head), HF {params['hf']:,}. "
        f"Compilation (dynamo + inductor, forward and backward graphs, inductor's on-disk cache "
        f"as found; not in the step times): raw loop {raw_compile_s:.1f} s (the first in this "
        f"process), then compile=true {compile_s:.1f} s. MFU "
        f"{achieved / peak:.1%} = {tps['lightning']:.0f} tokens/s x {fpt:,.0f} FLOPs/token / "
        f"{peak / 1e9:.1f} GFLOP/s peak. AdamW after {rows[-1].extra['steps']} steps: foreach "
        f"differs from the for-loop by {foreach:.2g} (max |param|), fused by {fused:.2g}."
    )
    report("train", rows, notes)
    if args.profile:
        for loop in loops:
            print(f"\n--- profile: {loop.name} raw loop, 3 steps")
            print(profile_loop(loop))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
