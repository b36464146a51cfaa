"""Compiled decoding and the sliding window, against plain recomputation.

Oracles: eager ``generate`` for the compiled static-shape decode step (same tokens, exactly), and
for the sliding window a loop that recomputes the window with a full forward and no cache at
every step, written here from the rule it implements: nanoGPT's ``idx[:, -block_size:]`` for
``window_stride=1``, and "when the context overflows, keep the last window - stride + 1 tokens"
for larger strides. Greedy comparisons are exact (argmax over the same logits up to float32
rounding; the tiny models' distributions are peaked enough that no near-tie flips).
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.decoding import GenerationConfig, HFModel, generate
from tests.decoding.tiny import hf_model, llmlab_model, prompts


def no_cache_window(model, ids, mask, new_tokens: int, window: int, stride: int):
    """Greedy decoding recomputing the current window from scratch at every step."""
    seq, start = ids, 0
    mask = mask.clone()
    for _ in range(new_tokens):
        if seq.shape[1] - start > window:
            start = seq.shape[1] - (window - stride + 1)
        logits = model(seq[:, start:], attention_mask=mask[:, start:])[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    return seq


@torch.no_grad()
def test_stride_one_is_nanogpts_crop():
    model = llmlab_model()
    ids, _ = prompts(100, batch=1, length=5, padded=False)
    got = generate(model, ids, max_new_tokens=40, sliding_window=12)
    seq = ids
    for _ in range(40):  # nanoGPT's sample loop
        logits = model(seq[:, -12:])[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq)


@torch.no_grad()
@pytest.mark.parametrize("stride", [1, 4, 11])
def test_sliding_window_equals_recomputing_the_window(stride):
    """Left-padded batch, prompt longer than the window: the window crops the prompt too, and
    positions are re-encoded from the cropped attention mask."""
    model = llmlab_model()
    ids, mask = prompts(100, batch=3, length=14)
    got = generate(
        model, ids, attention_mask=mask, max_new_tokens=30, sliding_window=12, window_stride=stride
    )
    assert torch.equal(got, no_cache_window(model, ids, mask, 30, window=12, stride=stride))


@torch.no_grad()
def test_sliding_window_sampling_is_the_same_with_and_without_the_cache():
    model = llmlab_model()
    ids, mask = prompts(100, batch=2, length=6)
    cfg = GenerationConfig(
        max_new_tokens=30, do_sample=True, top_k=20, seed=3, sliding_window=10, window_stride=3
    )
    cached = generate(model, ids, cfg, attention_mask=mask)
    uncached = generate(model, ids, cfg.replace(use_cache=False), attention_mask=mask)
    assert torch.equal(cached, uncached)


def test_window_and_compile_refuse_what_they_do_not_support():
    model = llmlab_model()
    ids, _ = prompts(100, batch=1, length=4, padded=False)
    bad = {
        "sliding_window must be None or an integer >= 2": dict(sliding_window=1),
        r"window_stride must be an integer in \[1, sliding_window - 1 = 7\], got 8": dict(
            sliding_window=8, window_stride=8
        ),
        "sliding_window works with greedy decoding and sampling, not strategy='beam'": dict(
            sliding_window=8, num_beams=2
        ),
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            generate(model, ids, max_new_tokens=4, **fields)
    with pytest.raises(ValueError, match="compile=True works with greedy decoding and sampling"):
        generate(model, ids, max_new_tokens=4, num_beams=2, compile=True)
    with pytest.raises(ValueError, match="HFModel has none"):
        generate(HFModel(hf_model()), ids, max_new_tokens=4, compile=True)


@torch.no_grad()
def test_compiled_forward_gives_the_eager_tokens():
    """Greedy, a left-padded batch and an unpadded one, then sampling with a seed: the compiled
    static-shape step (full-cache attention under a key mask) emits exactly eager's tokens."""
    model = llmlab_model()
    ids, mask = prompts(100, batch=3, length=7)
    eager = generate(model, ids, attention_mask=mask, max_new_tokens=24)
    compiled = generate(model, ids, attention_mask=mask, max_new_tokens=24, compile=True)
    assert torch.equal(compiled, eager)
    plain = torch.ones_like(mask)
    eager = generate(model, ids, attention_mask=plain, max_new_tokens=24)
    assert torch.equal(generate(model, ids, max_new_tokens=24, compile=True), eager)
    cfg = GenerationConfig(max_new_tokens=24, do_sample=True, top_k=10, seed=5)
    eager = generate(model, ids, cfg, attention_mask=mask)
    assert torch.equal(generate(model, ids, cfg, attention_mask=mask, compile=True), eager)


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_a_quantized_model_compiles_to_the_eager_tokens(scheme):
    """Quantized weights go through llmlab's C++ product, which dynamo cannot trace: a compiled
    graph calls it as the op ``llmlab::quantized_cpu_product`` (whole graph, no break), and the
    tokens equal eager's. Before, ``compile=True`` on a quantized model failed to trace."""
    from llmlab.models.quantize import quantize

    # a copy: quantize works in place, and llmlab_model is cached (shared with other tests)
    model = quantize(copy.deepcopy(llmlab_model("v300_e64_h4")), scheme)
    ids, mask = prompts(300, batch=3, length=7)
    eager = generate(model, ids, attention_mask=mask, max_new_tokens=16)
    compiled = generate(model, ids, attention_mask=mask, max_new_tokens=16, compile=True)
    assert torch.equal(compiled, eager)


@pytest.mark.slow
@torch.no_grad()
def test_compiled_forward_inside_a_sliding_window():
    """Re-encodes are eager prefills, the steps between them compiled: still the no-cache
    window recomputation's tokens."""
    model = llmlab_model()
    ids, mask = prompts(100, batch=2, length=6)
    got = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        sliding_window=12,
        window_stride=5,
        compile=True,
    )
    assert torch.equal(got, no_cache_window(model, ids, mask, 30, window=12, stride=5))
