"""Stepping an engine through a scripted arrival pattern, and the exactness tests' workload
(shared by the CPU and the GPU tests)."""

from __future__ import annotations

from llmlab.decoding import GenerationConfig
from llmlab.serving import EngineConfig, LLMEngine
from tests.serving.models import random_prompts


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> dict[str, list[list[int]]]:
    """Add ``arrivals[step]`` = [(id, prompt, config), ...] before each step; run to the end."""
    done: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished or any(k >= step for k in arrivals):
        for rid, prompt, config in arrivals.get(step, []):
            engine.add_request(rid, prompt, config)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [
                    o.token_ids for o in sorted(out.outputs, key=lambda o: o.index)
                ]
        step += 1
        assert step < 2000
    return done


PREFIX = list(range(40, 56))  # 16 tokens: 2 full blocks of 8


def workload(vocab: int) -> dict[int, list[tuple]]:
    lengths = [5, 17, 3, 29, 9, 12, 40, 6]
    prompts = random_prompts(vocab, lengths, seed=7)
    prompts[2] = PREFIX + prompts[2]  # share a prefix with request 5 and 7
    prompts[5] = PREFIX + prompts[5]
    prompts[7] = [*PREFIX, 1, 2, 3]
    new = [20, 7, 25, 12, 30, 18, 9, 22]
    arrivals: dict[int, list[tuple]] = {}
    for i, (p, n) in enumerate(zip(prompts, new)):
        config = GenerationConfig(max_new_tokens=n)
        if i == 4:  # n = 3 by sampling from top-1: three forks that must each be greedy's
            config = config.replace(num_return_sequences=3, do_sample=True, top_k=1, seed=0)
        arrivals.setdefault([0, 0, 1, 3, 3, 6, 10, 11][i], []).append((f"r{i}", p, config))
    return arrivals


def small_engine(model, **config) -> LLMEngine:
    """14 blocks of 8 tokens: far less than the workload wants at once, so it preempts.
    ``config``: further ``EngineConfig`` fields."""
    return LLMEngine(
        model,
        config=EngineConfig(
            block_size=8,
            num_blocks=14,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=112,
            **config,
        ),
    )


BEAM_CONFIGS = {
    "a": GenerationConfig(max_new_tokens=12, num_beams=4, num_return_sequences=2),
    # 253 is frequent under these weights: hypotheses end early and finish by eos
    "b": GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=253, length_penalty=0.5),
    "c": GenerationConfig(max_new_tokens=15, num_beams=2, early_stopping=True),
}


def beam_arrivals() -> dict[int, list[tuple]]:
    """Beam requests (configs ``BEAM_CONFIGS``) arriving beside plain ones."""
    prompts = random_prompts(300, [5, 11, 7, 9, 12, 8], seed=3)
    return {
        0: [
            ("a", prompts[0], BEAM_CONFIGS["a"]),
            ("g", prompts[3], GenerationConfig(max_new_tokens=14)),
        ],
        1: [("h", prompts[4], GenerationConfig(max_new_tokens=34))],
        2: [("b", prompts[1], BEAM_CONFIGS["b"])],
        3: [
            ("c", prompts[2], BEAM_CONFIGS["c"]),
            ("i", prompts[5], GenerationConfig(max_new_tokens=30)),
        ],
    }
