"""Done-when 1: the engine's tokens are the tokens of decoding each request alone.

Requests of mixed prompt and output lengths arrive at different steps; some share a 16-token
prefix (prefix-cache hits), the pool is small enough that sequences get preempted and
recomputed, and one request asks for n = 3 (a fork: the prompt's blocks are shared and its
partial block copied on write; it samples from the top-1 token, so each of its sequences must
be greedy's too). Oracles: ``llmlab.decoding.generate`` on each request alone,
and HF ``generate`` on the same random weights (GPT-2, and a grouped-query Llama). Greedy must
be token-identical (no tolerance). Seeded sampling must not depend on what else is batched.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.serving import EngineConfig, LLMEngine
from tests.serving.engine_steps import drive, small_engine, workload
from tests.serving.models import gpt_pair, hf_llama, llama, random_prompts


@pytest.fixture(scope="module")
def gpt_run():
    hf, model = gpt_pair()
    engine = small_engine(model)
    arrivals = workload(300)
    return hf, model, engine, arrivals, drive(engine, arrivals)


def test_greedy_equals_llmlab_generate_per_request_alone(gpt_run):
    _, model, engine, arrivals, done = gpt_run
    for batch in arrivals.values():
        for rid, prompt, config in batch:
            greedy = GenerationConfig(max_new_tokens=config.max_new_tokens)
            alone = generate(model, torch.tensor([prompt]), greedy)[0, len(prompt) :].tolist()
            assert done[rid] == [alone] * config.num_return_sequences, rid
    stats = engine.scheduler.blocks.stats()
    # the workload really exercised preemption, prefix hits and copy-on-write
    assert engine.scheduler.num_preemptions > 0 and stats.hits > 0 and stats.copies > 0
    assert stats.free == stats.total and all(
        b.ref_count == 0 for b in engine.scheduler.blocks.blocks
    )


def test_greedy_equals_hf_generate(gpt_run):
    hf, _, _, arrivals, done = gpt_run
    for batch in arrivals.values():
        for rid, prompt, config in batch:
            ids = torch.tensor([prompt])
            want = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=config.max_new_tokens,
                pad_token_id=0,
            )
            assert done[rid] == want[:, len(prompt) :].tolist() * config.num_return_sequences


def test_llama_greedy_equals_hf_and_llmlab_generate():
    hf, model = hf_llama(), llama()
    engine = LLMEngine(
        model,
        config=EngineConfig(
            block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64
        ),
    )
    prompts = random_prompts(200, [7, 19, 3, 11, 26], seed=3)
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(i // 3, []).append(
            (f"l{i}", p, GenerationConfig(max_new_tokens=12 + i))
        )
    done = drive(engine, arrivals)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=12 + i,
            pad_token_id=0,
        )[:, len(p) :].tolist()
        assert done[f"l{i}"] == want
        ours = generate(model, ids, GenerationConfig(max_new_tokens=12 + i))
        assert want == ours[:, len(p) :].tolist()
    assert engine.scheduler.num_preemptions > 0


SAMPLED = [
    GenerationConfig(max_new_tokens=15, do_sample=True, seed=1, temperature=0.7, top_k=20),
    GenerationConfig(max_new_tokens=9, do_sample=True, seed=2, top_p=0.9,
                     repetition_penalty=1.3),
    GenerationConfig(max_new_tokens=12, do_sample=True, seed=3, min_p=0.05,
                     no_repeat_ngram_size=2, temperature=1.4),
    GenerationConfig(max_new_tokens=11, do_sample=True, seed=4, num_return_sequences=2),
]  # fmt: skip


def test_seeded_sampling_does_not_depend_on_the_batch():
    _, model = gpt_pair()
    prompts = random_prompts(300, [6, 14, 9, 21], seed=11)
    config = EngineConfig(
        block_size=8, num_blocks=30, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=112
    )
    together = drive(LLMEngine(model, config=config), {
        0: [("s0", prompts[0], SAMPLED[0]), ("g", prompts[3], GenerationConfig(max_new_tokens=30))],
        2: [("s1", prompts[1], SAMPLED[1]), ("s2", prompts[2], SAMPLED[2])],
        5: [("s3", prompts[3], SAMPLED[3])],
    })  # fmt: skip
    for i, (prompt, params) in enumerate(zip(prompts, SAMPLED)):
        alone = drive(LLMEngine(model, config=config), {0: [("x", prompt, params)]})["x"]
        assert together[f"s{i}"] == alone
        if params.num_return_sequences == 1:  # and it is llmlab.decoding's draw, token for token
            ref = generate(model, torch.tensor([prompt]), params)[:, len(prompt) :].tolist()
            assert alone == ref
    assert together["s3"][0] != together["s3"][1]  # the two sequences draw independently
