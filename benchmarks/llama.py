"""The Llama against HF ``transformers``' ``LlamaForCausalLM`` with the same weights, on CPU.

A random-initialised Llama (4 layers, d=256, 8 query heads sharing 2 KV heads, SwiGLU 688 wide,
vocab 8192, untied head; 7.0M parameters) is built in ``transformers`` and loaded with
``Llama.from_hf``. Cases, each llmlab over HF (> 1: llmlab faster):

* a training step (forward + backward of the cross-entropy, batch 8 × 256 tokens), CPU seconds;
* greedy decoding of 128 new tokens at batch 1 and 8 (``llmlab.decoding.generate`` vs HF
  ``generate``), new tokens per CPU second; the tokens are checked to be identical.

It also reports the KV cache's bytes for this model against the same model with multi-head
attention (GQA's n_kv_head / n_head = 1/4). Run: ``.venv/bin/python -m benchmarks.llama``
(``--smoke``: a 1-layer model of width 64, 8 tokens, one repeat). One intra-op thread, CPU
time of this process (best of N), as in ``benchmarks/decoding.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import Row, best_of, parse_args, report

NEW_TOKENS = 128
PROMPT_LEN = 16
VOCAB = 8192


def build_models(smoke: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from llmlab.models import Llama

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64 if smoke else 256,
        intermediate_size=172 if smoke else 688,
        num_hidden_layers=1 if smoke else 4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(cfg)
    return hf, Llama.from_hf(hf)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser)
    new_tokens = 8 if args.smoke else NEW_TOKENS
    repeats = 1 if args.smoke else args.repeats
    rows_per_step, tokens_per_row = (2, 32) if args.smoke else (8, 256)
    torch.set_num_threads(1)

    from llmlab.decoding import GenerationConfig, generate
    from llmlab.models import Llama, LlamaConfig

    hf, ours = build_models(args.smoke)
    rows: list[Row] = []
    g = torch.Generator().manual_seed(1)

    # Training step: same batch, same weights; both in train mode (no dropout in either).
    ids = torch.randint(0, VOCAB, (rows_per_step, tokens_per_row + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step_hf() -> None:
        hf.zero_grad(set_to_none=True)
        F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).backward()

    def step_ours() -> None:
        ours.zero_grad(set_to_none=True)
        F.cross_entropy(ours(x).flatten(0, 1), y.flatten()).backward()

    hf.train()
    ours.train()
    clock = time.process_time
    t_hf = best_of(step_hf, repeats=repeats, warmup=1, clock=clock)
    t_ours = best_of(step_ours, repeats=repeats, warmup=1, clock=clock)
    rows.append(
        Row(
            name=f"train step fwd+bwd, {rows_per_step}x{tokens_per_row} tokens",
            llmlab=t_ours,
            reference=t_hf,
            reference_name="HF LlamaForCausalLM",
            unit="s",
            higher_is_better=False,
        )
    )
    print(f"  {rows[-1].name}: llmlab {t_ours:.3f}s, HF {t_hf:.3f}s")

    hf.eval()
    ours.eval()
    identical = True
    with torch.no_grad():
        for batch in (1, 8):
            prompt = torch.randint(0, VOCAB, (batch, PROMPT_LEN), generator=g)
            kw = dict(max_new_tokens=new_tokens, pad_token_id=0)
            cfg = GenerationConfig(**kw)

            def run_hf(prompt=prompt, kw=kw):
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)

            def run_ours(prompt=prompt, cfg=cfg):
                return generate(ours, prompt, cfg)

            identical &= torch.equal(run_hf(), run_ours())  # also warms both paths
            t_hf = best_of(run_hf, repeats=repeats, warmup=0, clock=clock)
            t_ours = best_of(run_ours, repeats=repeats, warmup=0, clock=clock)
            tokens = batch * new_tokens
            rows.append(
                Row(
                    name=f"greedy, batch {batch}",
                    llmlab=tokens / t_ours,
                    reference=tokens / t_hf,
                    reference_name="HF generate",
                    unit="new tokens/s",
                )
            )
            print(f"  {rows[-1].name}: llmlab {tokens / t_ours:.0f} tok/s, HF {tokens / t_hf:.0f}")

    mha = Llama(LlamaConfig(**{**ours.config.to_dict(), "n_kv_head": ours.config.n_head}))
    caches = [m.new_cache(8, PROMPT_LEN + new_tokens) for m in (ours, mha)]
    gqa_bytes, mha_bytes = (c.nbytes for c in caches)  # keys and values of every layer
    params = sum(p.numel() for p in ours.parameters())
    notes = (
        f"Llama {ours.config.n_layer}x{ours.config.n_embd}, 8 heads / 2 KV heads, vocab {VOCAB}, "
        f"{params / 1e6:.1f}M parameters "
        f"(random init), 1 thread, best CPU time of {repeats}; {new_tokens} new tokens after a "
        f"{PROMPT_LEN}-token prompt. Greedy tokens identical to HF: {identical}. KV cache at "
        f"batch 8 x {PROMPT_LEN + new_tokens} positions: {gqa_bytes / 2**20:.2f} MiB vs "
        f"{mha_bytes / 2**20:.2f} MiB with multi-head attention ({gqa_bytes / mha_bytes:.2f}x)."
    )
    report("llama", rows, notes)
    if not identical:
        raise SystemExit("outputs differ: the comparison is not like for like")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
