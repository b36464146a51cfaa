"""The serving engine on a CUDA model (skipped here: this machine has no GPU).

On CUDA the engine's attention goes through the Triton paged-attention kernel (``auto``), where
every CPU test runs the PyTorch reference. Oracles as on the CPU: the reference backend, and
``llmlab.decoding.generate`` on each request alone; also the CPU engine's tokens. Last run on an
NVIDIA H200 (torch 2.11, Triton 3.6) on 2026-12-04: passed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.models import GPT, GPTConfig
from llmlab.serving import LLM
from tests.serving.engine_steps import drive, small_engine, workload
from tests.serving.models import gpt_pair

pytestmark = pytest.mark.gpu


def test_triton_torch_and_auto_backends_decode_alike() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    model = model.cuda()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5, 5, 5]]
    config = GenerationConfig(max_new_tokens=4)
    outs = {}
    for backend in ("torch", "triton", "auto"):
        llm = LLM(model, block_size=4, num_blocks=16, max_num_seqs=4,
                  max_num_batched_tokens=8, attention_backend=backend)  # fmt: skip
        outs[backend] = [c.token_ids for c in llm.generate(prompts, config, progress=False)]
    assert outs["triton"] == outs["torch"] == outs["auto"], outs


def test_the_exactness_workload_on_cuda() -> None:
    """Preemption, prefix hits and an n = 3 fork on a CUDA model, through the Triton kernel:
    each request's tokens equal ``generate`` on it alone (on CUDA) and the CPU engine's."""
    _, cpu_model = gpt_pair()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    arrivals = workload(300)
    engine = small_engine(cuda_model)
    assert engine.runner.backend == "triton"
    done = drive(engine, arrivals)
    done_on_cpu = drive(small_engine(cpu_model), arrivals)
    for batch in arrivals.values():
        for rid, prompt, config in batch:
            greedy = GenerationConfig(max_new_tokens=config.max_new_tokens)
            ids = torch.tensor([prompt], device="cuda")
            alone = generate(cuda_model, ids, greedy)[0, len(prompt) :].tolist()
            assert done[rid] == [alone] * config.num_return_sequences, rid
            assert done[rid] == done_on_cpu[rid], rid
    stats = engine.scheduler.blocks.stats()
    assert engine.scheduler.num_preemptions > 0 and stats.hits > 0 and stats.copies > 0


def test_logprobs_on_cuda_equal_the_cpu_engines() -> None:
    """Generated and prompt log-probabilities (chunked prefill keeping every prompt row, the
    Triton kernel) equal the CPU engine's. Written with the log-probabilities on a machine
    without a GPU: not yet run on one."""
    from llmlab.serving import EngineConfig, LLMEngine, RequestOptions

    _, cpu_model = gpt_pair()
    config = EngineConfig(block_size=8, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16)
    prompt = list(range(3, 40))
    options = RequestOptions(logprobs=3, prompt_logprobs=3)
    results = []
    for model in (cpu_model, copy.deepcopy(cpu_model).cuda()):
        engine = LLMEngine(model, config=config)
        engine.add_request("r", prompt, GenerationConfig(max_new_tokens=8), options)
        generated, prompt_logprobs = [], None
        while engine.has_unfinished:
            for out in engine.step():
                prompt_logprobs = out.prompt_logprobs or prompt_logprobs
                generated += out.outputs[0].new_logprobs
        results.append((generated, prompt_logprobs))
    (cpu, cpu_prompt), (cuda, cuda_prompt) = results
    assert [lp.token_id for lp in cuda] == [lp.token_id for lp in cpu]
    assert len(cuda_prompt) == len(cpu_prompt) == len(prompt) and cuda_prompt[0] is None
    for a, b in zip(cpu + cpu_prompt[1:], cuda + cuda_prompt[1:]):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
