"""The model runner alone: one packed forward over the paged pool gives the logits a plain
forward of each sequence gives (atol 1e-5: the same maths, only the matmul blocking differs),
for GPT (multi-head) and Llama (grouped-query: the pool holds the KV heads only), and the
model keeps working unchanged outside the engine."""

from __future__ import annotations

import pytest
import torch

from llmlab.decoding import GenerationConfig
from llmlab.models import Llama, LlamaConfig
from llmlab.serving.block_manager import BlockManager
from llmlab.serving.config import EngineConfig
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.scheduler import Chunk
from llmlab.serving.sequence import Request
from tests.serving.models import gpt_pair, llama, random_prompts

CONFIG = EngineConfig(block_size=4, num_blocks=40, max_model_len=64)


def sequences(prompts: list[list[int]]) -> list:
    return [Request(str(i), p, GenerationConfig(), i).new_sequence(0, p)
            for i, p in enumerate(prompts)]  # fmt: skip


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_packed_paged_forward_equals_plain_forward(which):
    model = gpt_pair()[1] if which == "gpt" else llama()
    runner = ModelRunner(model, CONFIG)
    bm = BlockManager(CONFIG.num_blocks, CONFIG.block_size)
    a, b, c = sequences(random_prompts(200, [11, 23, 6], seed=1))
    # step 1: a whole prompt, the first chunk of b, and c
    plan = [(a, 11), (b, 9), (c, 6)]
    for seq, n in plan:
        assert bm.allocate(seq, n)
    logits = runner.execute([Chunk(s, 0, n) for s, n in plan])
    for seq, n in plan:
        seq.num_computed = n
    # step 2: a and c decode one token each, b's second chunk completes its prompt
    a.token_ids.append(5)
    c.token_ids.append(7)
    plan2 = [(a, 1), (b, 14), (c, 1)]
    for seq, n in plan2:
        assert bm.allocate(seq, n)
    logits2 = runner.execute([Chunk(s, s.num_computed, n) for s, n in plan2])
    with torch.no_grad():
        full = {id(s): model(torch.tensor([s.token_ids]))[0, -1] for s in (a, b, c)}
    assert logits.shape[0] == 2  # b's first chunk did not complete: no logits for it
    torch.testing.assert_close(logits[0], model(torch.tensor([a.token_ids[:11]]))[0, -1],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    for row, seq in enumerate((a, b, c)):
        torch.testing.assert_close(logits2[row], full[id(seq)], atol=1e-5, rtol=1e-5)


def test_the_pool_holds_the_kv_heads_only_under_grouped_query_attention():
    runner = ModelRunner(llama(), CONFIG)
    assert runner.num_layers == 2
    assert tuple(runner.pool.keys[0].shape) == (40, 4, 2, 12)  # 2 KV heads of dim 48 / 4


def test_the_model_is_unchanged_by_the_engine():
    """No attention swapped in, no weight re-laid or copied: the engine's forward is the
    model's own, with a context (the same tensors, bit for bit, before and after)."""
    model = gpt_pair()[1]
    x = torch.tensor([[3, 1, 4, 1, 5]])
    weights = {n: (t.data_ptr(), t.stride(), t.clone()) for n, t in model.state_dict().items()}
    modules = [type(m) for m in model.modules()]
    with torch.no_grad():
        before = model(x)
        runner = ModelRunner(model, CONFIG)
        seq = sequences([[3, 1, 4, 1, 5]])[0]
        assert BlockManager(CONFIG.num_blocks, CONFIG.block_size).allocate(seq, 5)
        runner.execute([Chunk(seq, 0, 5)])
        after = model(x)
        cache = model.new_cache(1, 8)  # and the decoding contract still works
        cached = model(x, attention=cache)
    torch.testing.assert_close(before, after, atol=0, rtol=0)
    torch.testing.assert_close(cached, before, atol=1e-6, rtol=1e-6)
    assert [type(m) for m in model.modules()] == modules
    for name, t in model.state_dict().items():
        ptr, stride, value = weights[name]
        assert (t.data_ptr(), t.stride()) == (ptr, stride) and torch.equal(t, value), name


def test_a_sliding_window_shorter_than_the_context_is_refused_by_the_probe():
    config = LlamaConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=48, intermediate_size=96, sliding_window=8)  # fmt: skip
    model = Llama(config).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 1\] attend through a sliding window of 8"):
        ModelRunner(model, CONFIG)
    ModelRunner(model, EngineConfig(block_size=4, num_blocks=40, max_model_len=8))


def test_a_model_without_the_contract_is_refused_by_name():
    with pytest.raises(TypeError, match=r"missing: forward\(positions=\), forward\(attention="):
        ModelRunner(torch.nn.Linear(2, 2), CONFIG)
