"""Serving: continuous batching on a paged KV cache vs static batching and HF's continuous one.

One model for everything: the decoding benchmark's random GPT-2 (4 layers x 256, vocab 8192),
in ``transformers`` for HF and loaded into ``llmlab.models.GPT`` for llmlab. One workload:
requests arriving as a Poisson process, fast enough that every system has a queue (throughput
then measures capacity, not the arrival rate; the notes give the time each llmlab system sat idle
waiting for a request), with log-uniform prompt and output lengths (many short, a few long, as
chat traffic is), greedy, no eos (every system does the same work). Three
systems serve it, each with the same KV memory (``STATIC_BATCH`` sequences of the longest
prompt + output):

* **continuous**: ``llmlab.serving.LLMEngine``, stepped as requests arrive (its defaults: on a
  CPU, products of two rows or more go through oneDNN on packed weights,
  ``llmlab.serving.linear``; a second run with ``onednn_linear=False``, every product through
  ``F.linear`` as the static system's, shows what the batching alone gives);
* **static**: ``llmlab.decoding.generate`` over left-padded batches of ``STATIC_BATCH`` requests
  in arrival order; a batch starts when its last request has arrived and the previous batch is
  done, and runs until its longest request ends (token times from a forward hook);
* **HF continuous batching**: a ``transformers`` ``ContinuousBatchingManager`` (what
  ``generate_batch`` runs) with the same number of blocks and block size, requests added at
  their arrival times, per-token timestamps recorded by HF.

Why 64 requests/s: at the 16/s this benchmark first used, the 32 requests took 2.7 s to arrive
and the continuous engine, on an idle machine, served them as they came (836 tokens/s: 2475
tokens over 2.96 s, the last arrival at 2.71 s): its throughput was the arrival rate's, whatever
the engine's speed, and so was HF's (876 tokens/s). At 64/s they arrive within 0.7 s.

Reported: output tokens/s (useful tokens / time from first arrival to last token), time to first
token and inter-token latency (p50 / p99), and the KV memory actually holding tokens over the
memory allocated (time-averaged over steps: paged = blocks in use; contiguous = each batch's
``rows x (longest prompt + longest output)``).

Clock: this shared machine's load swings several-fold within a minute, so wall time would
measure the neighbours. llmlab's two systems run on a *virtual clock*: this process's CPU
seconds (one thread: equal to wall time on an idle machine), jumping forward over idle gaps to
the next arrival. HF's manager stamps tokens with the wall clock in its own thread, so its times
are scaled by the CPU seconds the process used over the wall seconds of its run.

The hot path: one request, greedy, 256 new tokens, against HF ``generate`` and llmlab's
``generate`` (one thread, best CPU time of 4 interleaved rounds), with the engine's time per
token broken down: the 16 linear layers, the LM head, paged attention, the rest of the forward,
the engine's own bookkeeping, and the same matrix products timed alone (the fp32 floor: every
token reads all the weights; the "ceiling" row sets HF's rate against it, the ratio an engine
whose step cost nothing beyond its products would reach). The "bound" row decodes with a bare
step written out op by op (``bare_greedy``: no engine, no modules): how far eager PyTorch can
go here. The engine stores its weights in the memory order that multiplies one row fastest
here (``EngineConfig.tune_weight_layouts``, see ``llmlab.decoding.layout``); the notes name the
weights it moved. HF's GPT-2 keeps its own layout (Conv1D: column-major).
The engine's step at batch 1 is its hot path (``llmlab.serving.model_runner``): GPT's native
step (``llmlab.models.native``, one C++ call per token); a second row runs the same engine with
its step in Python (``native_step=False``: one SDPA call per layer on a slice of the pool, the
model's ``inference_forward`` without module dispatch), and the notes break both down. Two
more rows time the same lone request on a Llama of the same size (grouped-query, 4 heads over
2), with its native step and without (``llama_hot_path``).

Run: ``.venv/bin/python -m benchmarks.serving`` (``--smoke``: tiny sizes, seconds).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from benchmarks.common import Row, report
from benchmarks.common import best_of as common_best_of

STATIC_BATCH = 8
BLOCK_SIZE = 8


@dataclass
class Job:
    arrival: float  # seconds after the start
    prompt: list[int]
    new_tokens: int


@dataclass
class Trace:
    """When each request's useful tokens came out, and the KV utilisation samples."""

    name: str
    times: dict[int, list[float]] = field(default_factory=dict)  # job index -> token times
    tokens: dict[int, list[int]] = field(default_factory=dict)
    kv_used: list[float] = field(default_factory=list)  # used / allocated, per step
    arrivals: dict[int, float] = field(default_factory=dict)  # when each job entered, same clock
    idle: float = math.nan  # seconds spent waiting for a request with nothing to do (llmlab's)

    def summary(self, jobs: list[Job]) -> dict[str, float]:
        arrival = {i: self.arrivals.get(i, j.arrival) for i, j in enumerate(jobs)}
        ttft = [self.times[i][0] - arrival[i] for i in range(len(jobs))]
        itl = [b - a for ts in self.times.values() for a, b in itertools.pairwise(ts)]
        end = max(ts[-1] for ts in self.times.values())
        tokens = sum(len(ts) for ts in self.times.values())
        return {
            "throughput": tokens / (end - min(arrival.values())),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "kv_utilisation": statistics.fmean(self.kv_used) if self.kv_used else float("nan"),
            "span": end - min(arrival.values()),
        }  # fmt: skip


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def workload(n: int, prompt: tuple[int, int], new: tuple[int, int], rate: float) -> list[Job]:
    g = torch.Generator().manual_seed(0)

    def log_uniform(lo: int, hi: int) -> int:
        return round(math.exp(math.log(lo) + float(torch.rand(1, generator=g)) * math.log(hi / lo)))

    t, jobs = 0.0, []
    for _ in range(n):
        t += float(torch.empty(1).exponential_(rate, generator=g))
        length = log_uniform(*prompt)
        tokens = torch.randint(0, 8192, (length,), generator=g).tolist()
        jobs.append(Job(t, tokens, log_uniform(*new)))
    return jobs


class VirtualClock:
    """CPU seconds of this process since ``start()``, plus the idle gaps skipped to arrivals."""

    def start(self) -> float:
        self.origin, self.skipped = time.process_time(), 0.0
        return 0.0

    def now(self) -> float:
        return time.process_time() - self.origin + self.skipped

    def skip_to(self, t: float) -> None:
        self.skipped += max(0.0, t - self.now())


# ------------------------------------------------------------------------------ systems
def run_continuous(model, jobs: list[Job], num_blocks: int, max_len: int,
                   onednn_linear: bool = True) -> Trace:  # fmt: skip
    from llmlab.decoding import GenerationConfig
    from llmlab.serving import EngineConfig, LLMEngine

    engine = LLMEngine(model, config=EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=len(jobs),
        max_num_batched_tokens=256, max_model_len=max_len,
        onednn_linear=onednn_linear))  # fmt: skip
    trace = Trace("continuous")
    pending = list(enumerate(jobs))
    clock = VirtualClock()
    clock.start()
    while pending or engine.has_unfinished:
        while pending and pending[0][1].arrival <= clock.now():
            i, job = pending.pop(0)
            engine.add_request(str(i), job.prompt, GenerationConfig(max_new_tokens=job.new_tokens))
        if not engine.has_unfinished:
            clock.skip_to(pending[0][1].arrival)
            continue
        outputs = engine.step()
        stamp = clock.now()
        for out in outputs:
            i = int(out.request_id)
            trace.times.setdefault(i, []).extend([stamp] * len(out.outputs[0].new_token_ids))
            trace.tokens[i] = out.outputs[0].token_ids
        running = engine.scheduler.running
        held = engine.scheduler.blocks.stats().used * BLOCK_SIZE
        if held:
            trace.kv_used.append(sum(s.num_computed for s in running) / held)
    trace.idle = clock.skipped
    return trace


def run_static(model, jobs: list[Job]) -> Trace:
    from llmlab.decoding import GenerationConfig, generate

    trace = Trace("static")
    stamps: list[float] = []
    clock = VirtualClock()
    hook = model.register_forward_hook(lambda *_: stamps.append(clock.now()))
    clock.start()
    try:
        for b in range(0, len(jobs), STATIC_BATCH):
            batch = list(enumerate(jobs))[b : b + STATIC_BATCH]
            clock.skip_to(max(j.arrival for _, j in batch))
            width = max(len(j.prompt) for _, j in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (_, j) in enumerate(batch):
                ids[row, width - len(j.prompt) :] = torch.tensor(j.prompt)
                mask[row, width - len(j.prompt) :] = 1
            longest = max(j.new_tokens for _, j in batch)
            stamps.clear()
            out = generate(
                model, ids, GenerationConfig(max_new_tokens=longest), attention_mask=mask
            )
            for row, (i, j) in enumerate(batch):
                trace.times[i] = stamps[: j.new_tokens]
                trace.tokens[i] = out[row, width : width + j.new_tokens].tolist()
            allocated = len(batch) * (width + longest)
            for step in range(longest):  # useful tokens held at each step / the reservation
                used = sum(len(j.prompt) + min(step + 1, j.new_tokens) for _, j in batch)
                trace.kv_used.append(used / allocated)
    finally:
        hook.remove()
    trace.idle = clock.skipped
    return trace


def run_hf(hf, jobs: list[Job], num_blocks: int) -> Trace:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(j.new_tokens for j in jobs))  # fmt: skip
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=256,
        max_requests_per_batch=len(jobs),
    )  # fmt: skip
    trace = Trace("hf")
    manager = hf.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    try:
        ids = {}
        wall, cpu = time.perf_counter(), time.process_time()
        for i, job in enumerate(jobs):
            time.sleep(max(0.0, wall + job.arrival - time.perf_counter()))
            trace.arrivals[i] = time.perf_counter()
            rid = manager.add_request(job.prompt, max_new_tokens=job.new_tokens,
                                      record_timestamps=True)  # fmt: skip
            ids[rid] = i
        while len(trace.times) < len(jobs):
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF's continuous batching thread stopped")
                continue
            if result.is_finished():
                trace.times[ids[result.request_id]] = list(result.timestamps)
                trace.tokens[ids[result.request_id]] = list(result.generated_tokens)
        scale = (time.process_time() - cpu) / (time.perf_counter() - wall)
    finally:
        manager.stop(block=True)
    # wall seconds -> CPU seconds of this process, the other systems' clock
    trace.times = {i: [(t - wall) * scale for t in ts] for i, ts in trace.times.items()}
    trace.arrivals = {i: (t - wall) * scale for i, t in trace.arrivals.items()}
    return trace


# ------------------------------------------------------------------------------ hot path
def best_cpu(fn, repeats: int) -> float:
    return common_best_of(fn, repeats, warmup=0, clock=time.process_time)


def interleaved_best(systems: dict, repeats: int) -> dict[str, float]:
    """Each system's best CPU seconds over ``repeats`` interleaved rounds (one run of each per
    round): the machine's load drifts within a minute, so no system gets only the quiet part."""
    best = dict.fromkeys(systems, math.inf)
    for _ in range(repeats):
        for name, fn in systems.items():
            best[name] = min(best[name], best_cpu(fn, 1))
    return best


def hot_path(hf, model, new_tokens: int, repeats: int) -> tuple[list[Row], str]:
    from llmlab.decoding import GenerationConfig, generate
    from llmlab.serving import LLM

    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    sizes = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    llm = LLM(model, **sizes)
    python_step = LLM(model, **sizes, native_step=False)  # the same engine, its step in Python
    prompt = ids[0].tolist()
    for engine in (llm, python_step):  # warm
        engine.generate([prompt], cfg.replace(max_new_tokens=4), progress=False)
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=0)

    def run_hf():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, pad_token_id=0)  # fmt: skip

    same = llm.generate([prompt], cfg, progress=False)[0].token_ids[0] == run_hf()[0, 16:].tolist()
    systems = {
        "engine": lambda: llm.generate([prompt], cfg, progress=False),
        "python step": lambda: python_step.generate([prompt], cfg, progress=False),
        "hf": run_hf,
        "ours": lambda: generate(model, ids, cfg),
    }
    best = interleaved_best(systems, repeats)
    t_engine, t_hf, t_ours, t_python = best["engine"], best["hf"], best["ours"], best["python step"]
    native = llm.engine.runner.native.get() is not None
    rows = [
        Row("hot path: greedy batch 1 (engine) vs HF generate", new_tokens / t_engine,
            new_tokens / t_hf, "HF generate", "new tokens/s", target=2.0,
            extra={"identical": same, "native step": native}),
        Row("hot path: the engine with its step in Python (native_step=False) vs HF generate",
            new_tokens / t_python, new_tokens / t_hf, "HF generate", "new tokens/s"),
        Row("hot path: greedy batch 1 (engine) vs llmlab generate", new_tokens / t_engine,
            new_tokens / t_ours, "llmlab generate (contiguous cache)", "new tokens/s"),
    ]  # fmt: skip
    bare = bare_greedy(model, prompt, new_tokens)
    t_bare = min(best_cpu(bare, 1) for _ in range(repeats))
    floor = products_alone(llm.engine.model)
    rows += [
        Row("hot path bound: a bare eager step vs HF generate", new_tokens / t_bare,
            new_tokens / t_hf, "HF generate", "new tokens/s",
            extra={"identical": bare() == run_hf()[0, 16:].tolist()}),
        Row("hot path ceiling: the matrix products alone vs HF generate", 1e3 / floor,
            new_tokens / t_hf, "HF generate", "new tokens/s"),
    ]  # fmt: skip
    moved = [n for n, w in model.named_parameters() if w.dim() == 2 and w.stride(0) == 1]
    moved = ", ".join(moved) or "none"
    notes = [breakdown(engine, prompt, cfg, new_tokens, floor) for engine in (llm, python_step)]
    notes.append(products_note(llm.engine.model, floor))
    return rows, f"{' '.join(notes)} Column-major weights: {moved}."


def llama_hot_path(new_tokens: int, repeats: int) -> tuple[str, list[Row]]:
    """A lone request's greedy decode on a Llama of the GPT's size (4 x 256, vocab 8192, 4 query
    heads over 2 KV heads, MLP 688), against HF ``generate``, with the native step and with the
    step in Python (the engine's general path for this model: it has no ``inference_forward``)."""
    import transformers

    from llmlab.decoding import GenerationConfig
    from llmlab.models import Llama
    from llmlab.serving import LLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    model = Llama.from_hf(hf).eval()
    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    prompt, cfg = ids[0].tolist(), GenerationConfig(max_new_tokens=new_tokens)
    sizes = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    engines = {"native": LLM(model, **sizes), "python": LLM(model, **sizes, native_step=False)}

    def run_hf():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, pad_token_id=0)  # fmt: skip

    want = run_hf()[0, 16:].tolist()
    same = {n: e.generate([prompt], cfg, progress=False)[0].token_ids[0] == want
            for n, e in engines.items()}  # fmt: skip
    systems = {n: functools.partial(e.generate, [prompt], cfg, progress=False)
               for n, e in engines.items()}  # fmt: skip
    systems["hf"] = run_hf
    rate = {name: new_tokens / t for name, t in interleaved_best(systems, repeats).items()}
    native = engines["native"].engine.runner.native.get() is not None
    note = (
        f"Llama hot path: native step {'on' if native else 'OFF'}; the engine's tokens equal "
        f"HF's: native {same['native']}, Python step {same['python']}."
    )
    return note, [
        Row("hot path, Llama (GQA 4/2): greedy batch 1 (engine) vs HF generate", rate["native"],
            rate["hf"], "HF generate", "new tokens/s",
            extra={"identical": same["native"], "native step": native}),
        Row("hot path, Llama: the engine with its step in Python vs HF generate",
            rate["python"], rate["hf"], "HF generate", "new tokens/s",
            extra={"identical": same["python"]}),
    ]  # fmt: skip


def bare_greedy(model, prompt: list[int], new_tokens: int):
    """Greedy decoding of ``model`` (the benchmark's GPT) with nothing left to cut: weights
    resolved once, one ATen call per op, a contiguous cache per layer, no engine, no module
    dispatch. Not a system, a bound: how fast eager PyTorch runs this step on one thread.
    Returns a function that decodes and returns the new token ids."""
    cfg = model.config
    width, heads = cfg.n_embd, cfg.n_head
    dim, length = width // heads, len(prompt) + new_tokens
    layers = [
        (b.ln_1.weight, b.ln_1.bias, b.attn.qkv.weight, b.attn.qkv.bias, b.attn.proj.weight,
         b.attn.proj.bias, b.ln_2.weight, b.ln_2.bias, b.mlp.fc.weight, b.mlp.fc.bias,
         b.mlp.proj.weight, b.mlp.proj.bias, torch.zeros(length, heads, dim),
         torch.zeros(length, heads, dim))
        for b in model.blocks
    ]  # fmt: skip
    wte, wpe = model.embed.wte.weight, model.embed.wpe.weight
    ln_f, lm_head = model.head.ln_f, model.head.lm_head.weight
    linear, norm, gelu = torch._C._nn.linear, torch.layer_norm, torch._C._nn.gelu
    sdpa, scale, eps = torch._C._nn.scaled_dot_product_attention, dim**-0.5, ln_f.eps

    def forward(ids: Tensor, start: int) -> Tensor:
        end = start + ids.numel()
        x = (wte[ids] + wpe[start:end])[None]
        for l1w, l1b, qw, qb, pw, pb, l2w, l2b, fw, fb, mw, mb, keys, values in layers:
            qkv = linear(norm(x, (width,), l1w, l1b, eps), qw, qb).view(-1, heads, 3, dim)
            keys[start:end], values[start:end] = qkv[:, :, 1], qkv[:, :, 2]
            q = qkv[:, :, 0].transpose(0, 1)[None]
            k, v = keys[:end].transpose(0, 1)[None], values[:end].transpose(0, 1)[None]
            y = sdpa(q, k, v, is_causal=start == 0, scale=scale)
            x = x + linear(y[0].transpose(0, 1).reshape(1, -1, width), pw, pb)
            x = x + linear(gelu(linear(norm(x, (width,), l2w, l2b, eps), fw, fb)), mw, mb)
        return linear(norm(x[:, -1], (width,), ln_f.weight, ln_f.bias, eps), lm_head)

    def tokens() -> list[int]:
        out = [int(forward(torch.tensor(prompt), 0).argmax())]
        for p in range(len(prompt), length - 1):
            out.append(int(forward(torch.tensor([out[-1]]), p).argmax()))
        return out

    return tokens


def products_alone(model) -> float:
    """Milliseconds per token of a decode step's matrix products alone, back to back: the floor
    no bookkeeping can go under at fp32 (every token reads every weight once)."""
    import torch.nn.functional as F

    products = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {w.shape[1]: torch.randn(1, 1, w.shape[1]) for w, _ in products}

    def all_products():
        for w, b in products:
            F.linear(rows[w.shape[1]], w, b)

    return best_cpu(lambda: [all_products() for _ in range(20)], 3) / 20 * 1e3


def breakdown(llm, prompt: list[int], cfg, new_tokens: int, alone: float) -> str:
    """Where one engine token's CPU time goes: timers around the parts of a step, beside the
    matrix products alone (``alone``, ms per token). With the native step, the model's forward
    is one call the timers cannot look into; with the Python step, they split it by op."""
    import torch.nn.functional as F

    engine = llm.engine
    runner = engine.runner
    module = sys.modules[type(runner).__module__]
    vocab = engine.model.config.vocab_size
    native = runner.native.get()
    spent: dict[str, float] = {}

    def timed(name, fn, key=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                part = key(*args) if key else name
                spent[part] = spent.get(part, 0.0) + time.process_time() - start

        return wrapper

    def linear_part(x, weight, *_):
        return "lm_head" if weight.shape[0] == vocab else "linear"

    patches = [(runner, "execute", timed("forward", runner.execute))]
    if native is not None:
        patches.append((runner.native, "_step", timed("native", native)))
    else:
        patches += [
            (F, "linear", timed("", F.linear, linear_part)),
            (module, "_attend_single", timed("attention", module._attend_single)),
            (module, "_attend_each", timed("attention", module._attend_each)),
            (module, "paged_attention", timed("attention", module.paged_attention)),
        ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        start = time.process_time()
        llm.generate([prompt], cfg, progress=False)
        total = (time.process_time() - start) / new_tokens * 1e3
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    ms = {k: v / new_tokens * 1e3 for k, v in spent.items()}
    engine_part = f"scheduler, sampling and bookkeeping {total - ms['forward']:.2f}"
    if native is not None:
        return (
            f"Engine, greedy batch 1, per token (timers on): {total:.2f} ms = the native step "
            f"{ms['native']:.2f} (its 17 products alone {alone:.2f}, so "
            f"{ms['native'] - alone:.2f} for the rest: attention through the block table (KV "
            f"writes and reads), layer norms, GELU, adds) + the runner around it "
            f"{ms['forward'] - ms['native']:.2f} + "
            f"{engine_part}."
        )
    rest = ms["forward"] - ms["linear"] - ms["lm_head"] - ms["attention"]
    return (
        f"Engine with its step in Python, per token (timers on): {total:.2f} ms = model forward "
        f"{ms['forward']:.2f} (16 linear layers {ms['linear']:.2f}, LM head 256x{vocab} "
        f"{ms['lm_head']:.2f}, paged attention (4 layers, KV write + SDPA) {ms['attention']:.2f}, "
        f"the rest: embeddings, layer norms, GELU, residual adds, views, Python {rest:.2f}) + "
        f"{engine_part}."
    )


def products_note(model, alone: float) -> str:
    products = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in products)
    return (
        f"The same {len(products)} products alone, one after another: {alone:.2f} ms per token "
        f"({nbytes / 1e6:.1f} MB of fp32 weights read at {nbytes / alone / 1e6:.0f} GB/s)."
    )


# ------------------------------------------------------------------------------ main
def build_models():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from llmlab.models import GPT

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=8192, n_positions=512, n_embd=256, n_layer=4, n_head=4,
                     bos_token_id=None, eos_token_id=None)  # fmt: skip
    hf = GPT2LMHeadModel(cfg).eval()
    return hf, GPT.from_hf_gpt2(hf).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        jobs = workload(6, (4, 12), (2, 6), rate=200.0)
        hot_tokens, repeats = 8, 1
    else:
        jobs = workload(32, (8, 256), (8, 256), rate=64.0)
        hot_tokens, repeats = 256, 4
    longest = max(len(j.prompt) for j in jobs) + max(j.new_tokens for j in jobs)
    num_blocks = -(-STATIC_BATCH * longest // BLOCK_SIZE)  # the static batch's KV memory
    hf, model = build_models()
    with torch.inference_mode():
        run_continuous(model, jobs[:2], num_blocks, longest)  # warm-up: first-call costs
        traces = [run_continuous(model, jobs, num_blocks, longest), run_static(model, jobs),
                  run_hf(hf, jobs, num_blocks)]  # fmt: skip
        plain = run_continuous(model, jobs, num_blocks, longest, onednn_linear=False)
        hot_rows, profile = hot_path(hf, model, hot_tokens, repeats)
        llama_note, llama_rows = llama_hot_path(hot_tokens, max(1, repeats // 2))
        hot_rows += llama_rows
    cont, static, hf_cb = (t.summary(jobs) for t in traces)
    plain_throughput = plain.summary(jobs)["throughput"]
    same = {t.name: sum(t.tokens[i] == traces[0].tokens[i] for i in range(len(jobs)))
            for t in (*traces[1:], plain)}  # fmt: skip

    def pair(name, key, other, other_name, higher, target=None, unit="s"):
        return Row(name, cont[key], other[key], other_name, unit, higher, target)

    rows = [
        pair("throughput: continuous vs static (same KV memory)", "throughput", static,
             "llmlab static batching", True, 2.0, "output tokens/s"),
        Row("throughput: continuous, every product F.linear (onednn_linear=False) vs static",
            plain_throughput, static["throughput"], "llmlab static batching", "output tokens/s"),
        pair("throughput: continuous vs HF continuous batching", "throughput", hf_cb,
             "HF generate_batch manager", True, 1.0, "output tokens/s"),
    ]  # fmt: skip
    for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                       ("itl_p50", "ITL p50"), ("itl_p99", "ITL p99")):  # fmt: skip
        rows.append(pair(f"{label}: continuous vs static", key, static, "static batching", False))
        rows.append(pair(f"{label}: continuous vs HF", key, hf_cb, "HF continuous batching", False))
    waste_paged, waste_static = 1 - cont["kv_utilisation"], 1 - static["kv_utilisation"]
    rows += [
        Row("KV waste (1 - used/allocated): paged, target <= 5 %", waste_paged, 0.05,
            "the 5 % target", "fraction", False, 1.0),
        Row("KV waste: paged vs contiguous (static batches)", waste_paged, waste_static,
            "contiguous reservation", "fraction", False),
        *hot_rows,
    ]  # fmt: skip
    notes = (
        f"{len(jobs)} requests, Poisson arrivals over {jobs[-1].arrival:.1f} s, prompts "
        f"{min(len(j.prompt) for j in jobs)}-{max(len(j.prompt) for j in jobs)} tokens, outputs "
        f"{min(j.new_tokens for j in jobs)}-{max(j.new_tokens for j in jobs)}; KV memory for all: "
        f"{STATIC_BATCH} x {longest} token slots ({num_blocks} blocks of {BLOCK_SIZE}). GPT-2 "
        f"4x256 vocab 8192 (random), greedy, no eos, 1 thread, CPU-time clock. Requests with "
        f"the engine's tokens: static {same['static']}/{len(jobs)}, HF {same['hf']}/{len(jobs)}, "
        f"the engine with F.linear products {same['continuous']}/{len(jobs)}. Idle, waiting for "
        f"a request: continuous {traces[0].idle:.2f} s of its {cont['span']:.2f} s, static "
        f"{traces[1].idle:.2f} s of {static['span']:.2f} s. "
        f"{profile} {llama_note}"
    )
    report("serving", rows, notes)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
