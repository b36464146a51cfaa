"""The engine with ``EngineConfig.quantize``: the model's linear layers are converted in place
(no full-precision copy kept) and the engine's greedy tokens are ``generate``'s on the same
quantized model, token for token; a bad scheme is refused before anything is built."""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.models import QuantizedLinear, quantize
from llmlab.serving import EngineConfig, LLMEngine
from tests.serving.engine_steps import drive
from tests.serving.models import llama, random_prompts


@pytest.mark.parametrize("scheme", ["bf16", "int8"])  # int4 needs widths of 32s
def test_a_quantized_engine_decodes_as_generate_on_the_quantized_model(scheme):
    model = copy.deepcopy(llama())  # the helper's model is shared: quantize a copy
    reference = quantize(copy.deepcopy(model), scheme)
    engine = LLMEngine(model, config=EngineConfig(block_size=8, num_blocks=32, quantize=scheme))
    assert engine.model is model and isinstance(model.head.lm_head, QuantizedLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    prompts = random_prompts(200, [7, 19, 4], seed=3)
    config = GenerationConfig(max_new_tokens=12)
    arrivals = {0: [(f"r{i}", p, config) for i, p in enumerate(prompts)]}
    done = drive(engine, arrivals)
    for i, prompt in enumerate(prompts):
        alone = generate(reference, torch.tensor([prompt]), config)[0, len(prompt) :].tolist()
        assert done[f"r{i}"] == [alone], i


def test_a_bad_scheme_is_refused_before_the_engine_is_built():
    model = copy.deepcopy(llama())  # the helper's model is shared: quantize a copy
    with pytest.raises(ValueError, match=r"EngineConfig: quantize='int3' is not a scheme; valid"):
        LLMEngine(model, config=EngineConfig(block_size=8, num_blocks=32, quantize="int3"))
    assert isinstance(model.head.lm_head, torch.nn.Linear)  # untouched


def test_a_bf16_kv_pool_halves_the_cache_and_stays_close():
    """kv_cache_dtype="bfloat16": the pool holds half an fp32 pool's bytes; the greedy tokens of
    a short decode agree with the fp32 pool's (keys and values rounded to bf16 only)."""
    model = llama()
    sizes = dict(block_size=8, num_blocks=32)
    fp32 = LLMEngine(model, config=EngineConfig(**sizes))
    bf16 = LLMEngine(model, config=EngineConfig(**sizes, kv_cache_dtype="bfloat16"))
    assert bf16.runner.pool.keys[0].dtype == torch.bfloat16
    assert bf16.runner.pool.nbytes * 2 == fp32.runner.pool.nbytes
    prompts = random_prompts(200, [9, 14], seed=4)
    config = GenerationConfig(max_new_tokens=6)
    arrivals = {0: [(f"r{i}", p, config) for i, p in enumerate(prompts)]}
    assert drive(bf16, arrivals) == drive(fp32, arrivals)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'; valid: \['auto', 'bfloat16'"):
        EngineConfig(kv_cache_dtype="int8").validate()
