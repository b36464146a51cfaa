"""Beam search in the engine: the hypotheses of ``llmlab.decoding`` and HF, on shared KV blocks.

Oracles: ``llmlab.decoding.generate`` (``num_beams``, contiguous cache, each request alone) and
HF ``generate(num_beams=...)`` on the same random GPT-2 weights; token-identical (no tolerance).
The engine runs beam requests next to greedy ones, arriving at different steps, in a pool small
enough to preempt. Sharing: a request's beams hold fewer blocks than ``num_beams`` private
copies would, partial blocks are copied on write, and every block is free at the end.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.serving import EngineConfig, LLMEngine
from tests.serving.engine_steps import beam_arrivals, drive
from tests.serving.models import gpt_pair, random_prompts


def engine_for(model, num_blocks: int) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(
        block_size=4, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=32,
        max_model_len=48))  # fmt: skip


def references(hf, model) -> dict[str, tuple[list, list]]:
    """Per request: llmlab.decoding's and HF's hypotheses (generated tokens), each alone."""
    refs = {}
    for rid, prompt, config in requests():
        ids = torch.tensor([prompt])
        ours = generate(model, ids, config)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=config.num_beams, max_new_tokens=config.max_new_tokens,
                             num_return_sequences=config.num_return_sequences,
                             eos_token_id=config.eos_token_ids or None, pad_token_id=0,
                             length_penalty=config.length_penalty,
                             early_stopping=config.early_stopping)  # fmt: skip
        refs[rid] = ([r[len(prompt) :].tolist() for r in ours],
                     [r[len(prompt) :].tolist() for r in theirs])  # fmt: skip
    return refs


@pytest.fixture(scope="module")
def runs():
    hf, model = gpt_pair()
    out = {}
    for blocks in (64, 20):  # roomy, and tight enough to preempt (a's 4 beams need 20)
        engine = engine_for(model, blocks)
        out[blocks] = (engine, drive(engine, beam_arrivals()))
    return references(hf, model), out


def requests():
    return [r for step in beam_arrivals().values() for r in step]


@pytest.mark.parametrize("blocks", [64, 20])
def test_beams_equal_llmlab_and_hf_beam_search(runs, blocks):
    refs, out = runs
    engine, done = out[blocks]
    if blocks == 20:
        assert engine.scheduler.num_preemptions > 0  # the tight pool really preempted
    for rid, _, config in requests():
        ours, theirs = refs[rid]
        # shorter hypotheses are padded in the references: compare up to the engine's length
        for got, a, b in zip(done[rid], ours, theirs, strict=True):
            assert got == a[: len(got)] == b[: len(got)], rid
            assert len(got) == config.max_new_tokens or got[-1] in config.eos_token_ids
    assert done["b"][0][-1] == 253 and len(done["b"][0]) < 10  # finished by eos


@pytest.mark.parametrize("blocks", [64, 20])
def test_every_block_returns_to_the_pool(runs, blocks):
    engine = runs[1][blocks][0]
    stats = engine.scheduler.blocks.stats()
    assert stats.free == stats.total and not engine.scheduler.running
    engine.scheduler.blocks.check([])  # every reference count is back to zero


def test_beams_share_blocks_and_copy_partial_ones_on_write():
    _, model = gpt_pair()
    engine = engine_for(model, 64)
    prompt = random_prompts(300, [10], seed=5)[0]
    config = GenerationConfig(max_new_tokens=20, num_beams=4)
    engine.add_request("x", prompt, config)
    peak, done = 0, None
    while engine.has_unfinished:
        for out in engine.step():
            done = out
        peak = max(peak, engine.scheduler.blocks.stats().used)
    # 4 private copies of the longest beam (30 tokens in blocks of 4) would need 32 blocks
    private = config.num_beams * -(-(len(prompt) + config.max_new_tokens) // 4)
    assert peak < private * 0.75, (peak, private)
    assert engine.scheduler.blocks.stats().copies > 0  # shared partial blocks were copied
    assert engine.scheduler.blocks.stats().free == 64
    ref = generate(model, torch.tensor([prompt]), config)[0, len(prompt) :].tolist()
    assert done.finished and done.outputs[0].token_ids == ref
    assert done.outputs[0].finish_reason == "length"


def test_abort_mid_search_frees_every_beam():
    _, model = gpt_pair()
    engine = engine_for(model, 64)
    engine.add_request("x", random_prompts(300, [6], seed=1)[0],
                       GenerationConfig(max_new_tokens=20, num_beams=3))  # fmt: skip
    for _ in range(5):
        assert engine.step() == []  # beams report only their final hypotheses
    assert engine.scheduler.blocks.stats().used > 0
    engine.abort("x")
    assert engine.scheduler.blocks.stats().free == 64 and not engine.has_unfinished
    engine.scheduler.blocks.check([])


def test_a_pool_too_small_for_the_beams_is_refused_up_front():
    _, model = gpt_pair()
    engine = engine_for(model, 16)
    with pytest.raises(ValueError, match=r"num_beams=4 beams .* 40 KV blocks"):
        engine.add_request("x", [1] * 30, GenerationConfig(max_new_tokens=10, num_beams=4))
