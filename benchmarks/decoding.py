"""Decoding throughput: llmlab.decoding on llmlab.models.GPT vs HF ``generate``, same weights.

A random-initialised 5.4M-parameter GPT-2 (4 layers, d=256, 4 heads, vocab 8192) is built in
``transformers`` and loaded into ``llmlab.models.GPT`` with ``GPT.from_hf_gpt2``. Each case
generates 256 new tokens (no eos, so every run does the same work) at batch 1 and 8, and
reports new tokens per second (batch x 256 / best CPU time), llmlab over HF. Greedy outputs are
checked to be identical. Greedy also runs with ``generate(..., compile=True)`` (the static-shape
decode step through ``torch.compile``; compile time reported in the notes, not in the rate),
against HF and against llmlab's uncompiled path, with the same tokens. Speculative decoding uses
the target's own first block as the draft (layer skipping: same embeddings and head) and is
compared with llmlab greedy.

Run: ``.venv/bin/python -m benchmarks.decoding`` (``--smoke``: a 1-layer model of width 64, 8
tokens, one repeat, no compilation). One intra-op
thread for both sides (on a shared 2-core machine extra threads mostly spin, see
tests/decoding), timed in CPU seconds of this process (see ``best_of`` below).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.common import Row, parse_args, report
from benchmarks.common import best_of as common_best_of

NEW_TOKENS = 256
PROMPT_LEN = 16


def best_of(fn, repeats: int = 2, warmup: int = 0) -> float:
    """Best CPU time of ``repeats`` calls.

    Both sides run on one thread, so on an idle machine CPU time equals wall time; on this
    shared machine, with other jobs queued on the cores, CPU time still measures the work done
    while wall time mostly measures the queue.
    """
    return common_best_of(fn, repeats, warmup, clock=time.process_time)


def compiled_rows(ours, ids, cfg, tokens, t_hf, t_eager, compile_seconds) -> list[Row]:
    """Greedy through the compiled decode step: against HF generate and the eager path."""
    from llmlab.decoding import generate

    start = time.perf_counter()
    first = generate(ours, ids, cfg, compile=True)  # compiles (static shapes: this length)
    compile_seconds[ids.shape[0]] = time.perf_counter() - start
    same = torch.equal(first, generate(ours, ids, cfg))
    t = best_of(lambda: generate(ours, ids, cfg, compile=True), repeats=2, warmup=0)
    batch = ids.shape[0]
    common = dict(unit="new tokens/s", extra={"identical": same})
    print(f"  greedy compiled, batch {batch}: {tokens / t:.0f} tok/s")
    return [
        Row(f"greedy compile=True, batch {batch}", tokens / t, tokens / t_hf, "HF generate",
            target=2.0 if batch == 1 else None, **common),
        Row(f"greedy compile=True / eager, batch {batch}", tokens / t, tokens / t_eager,
            "llmlab greedy, uncompiled", **common),
    ]  # fmt: skip


def build_models(smoke: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from llmlab.models import GPT

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=8192,
        n_positions=512,
        n_embd=64 if smoke else 256,
        n_layer=1 if smoke else 4,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    ours = GPT.from_hf_gpt2(hf).eval()
    draft = copy.deepcopy(ours)
    draft.blocks = draft.blocks[:1]
    draft.config.n_layer = 1
    return hf, ours, draft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parse_args(parser)
    new_tokens = 8 if args.smoke else NEW_TOKENS
    repeats = 1 if args.smoke else args.repeats
    torch.set_num_threads(1)

    from llmlab.decoding import GenerationConfig, generate, speculative_generate

    hf, ours, draft = build_models(args.smoke)
    g = torch.Generator().manual_seed(1)
    cases = [
        ("greedy", 1, dict()),
        ("greedy", 8, dict()),
        (
            "sampling (T=0.8, top-k 50, top-p 0.95)",
            1,
            dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95),
        ),
        (
            "sampling (T=0.8, top-k 50, top-p 0.95)",
            8,
            dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95),
        ),
        ("beam-4", 1, dict(num_beams=4)),
        ("beam-4", 8, dict(num_beams=4)),
    ]
    rows: list[Row] = []
    identical = True
    compile_seconds: dict[int, float] = {}
    with torch.no_grad():
        for name, batch, fields in cases:
            ids = torch.randint(0, 8192, (batch, PROMPT_LEN), generator=g)
            kw = dict(max_new_tokens=new_tokens, pad_token_id=0, **fields)
            cfg = GenerationConfig(**kw)

            def run_hf(ids=ids, kw=kw):
                return hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)

            def run_ours(ids=ids, cfg=cfg):
                return generate(ours, ids, cfg)

            # warm both paths with a short run, then time best-of-N full runs
            hf.generate(ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 4})
            generate(ours, ids, cfg.replace(max_new_tokens=4))
            if name == "greedy":
                identical &= torch.equal(run_hf(), run_ours())
            t_hf = best_of(run_hf, repeats=repeats, warmup=0)
            t_ours = best_of(run_ours, repeats=repeats, warmup=0)
            tokens = batch * new_tokens
            rows.append(
                Row(
                    name=f"{name}, batch {batch}",
                    llmlab=tokens / t_ours,
                    reference=tokens / t_hf,
                    reference_name="HF generate",
                    unit="new tokens/s",
                    target=1.3 if name == "greedy" else None,
                )
            )
            print(f"  {rows[-1].name}: llmlab {tokens / t_ours:.0f} tok/s, HF {tokens / t_hf:.0f}")
            if name == "greedy" and not args.smoke:  # compiling takes tens of seconds
                rows += compiled_rows(ours, ids, cfg, tokens, t_hf, t_ours, compile_seconds)
                identical &= rows[-1].extra["identical"]

        # speculative: layer-skip draft (the target's first block), k = 4, greedy, batch 1
        ids = torch.randint(0, 8192, (1, PROMPT_LEN), generator=g)
        cfg = GenerationConfig(max_new_tokens=new_tokens, num_assistant_tokens=4)
        speculative_generate(ours, draft, ids, cfg.replace(max_new_tokens=4))
        plain = generate(ours, ids, cfg)
        spec, stats = speculative_generate(ours, draft, ids, cfg)
        identical &= torch.equal(plain, spec)
        t_plain = best_of(lambda: generate(ours, ids, cfg), repeats=repeats, warmup=0)
        t_spec = best_of(
            lambda: speculative_generate(ours, draft, ids, cfg), repeats=repeats, warmup=0
        )
        rows.append(
            Row(
                name="speculative greedy (1-block draft, k=4), batch 1",
                llmlab=new_tokens / t_spec,
                reference=new_tokens / t_plain,
                reference_name="llmlab greedy",
                unit="new tokens/s",
                extra={
                    "acceptance_rate": stats.acceptance_rate,
                    "target_calls": stats.target_calls,
                },
            )
        )
    compiled = ", ".join(f"batch {b}: {t:.0f} s" for b, t in compile_seconds.items()) or "not run"
    notes = (
        f"compile=True: first call (compilation) {compiled} wall time, excluded from the rate. "
        f"{new_tokens} new tokens, prompt {PROMPT_LEN}, GPT-2 {ours.config.n_layer}x"
        f"{ours.config.n_embd} vocab 8192 (random init), "
        f"1 thread, best CPU time of {repeats}. Greedy/speculative tokens identical to HF/plain: "
        f"{identical}. Speculative acceptance rate {stats.acceptance_rate:.2f} "
        f"({stats.target_calls} target calls for {new_tokens} tokens)."
    )
    report("decoding", rows, notes)
    if not identical:
        raise SystemExit("outputs differ: the comparison is not like for like")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
