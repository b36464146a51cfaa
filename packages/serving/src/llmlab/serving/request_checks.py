"""The checks a request passes before the engine queues it: every value it cannot serve is a
``ValueError`` naming it (the server's 400s), so that no bad request ever starts work."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from llmlab.decoding import GenerationConfig
from llmlab.serving.config import EngineConfig
from llmlab.serving.sequence import SEED_RANGE, RequestOptions
from llmlab.serving.structured import Grammars

SUPPORTED_STRATEGIES = ("greedy", "sample", "beam")


def check_request_values(
    engine_config: EngineConfig,
    vocab: int,
    tokenizer: Any,
    grammars: Grammars,
    prompt_ids: list[int],
    config: GenerationConfig,
    options: RequestOptions,
    adapters: Collection[str] = (),
) -> None:
    """Raise ``ValueError`` naming what is wrong with a request's prompt, decoding settings
    and options, against the engine's limits (its context, pool and batch) and the LoRA
    ``adapters`` it serves."""
    config.validate()
    if options.adapter is not None and options.adapter not in adapters:
        served = f"the served adapters are {sorted(adapters)}" if adapters else "none is served"
        raise ValueError(
            f"unknown LoRA adapter {options.adapter!r}: {served} (adapter=None: the base model)"
        )
    strategy = config.resolved_strategy()
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(
            f"strategy {strategy!r} (num_beams={config.num_beams}) is not served; the "
            f"engine decodes {list(SUPPORTED_STRATEGIES)} (use llmlab.decoding.generate)"
        )
    if strategy == "beam" and config.do_sample:
        raise ValueError(
            f"beam sampling (num_beams={config.num_beams} with do_sample=True) is not served; "
            f"the engine runs deterministic beam search (do_sample=False), or use "
            f"llmlab.decoding.generate"
        )
    if config.sliding_window is not None or not config.use_cache:
        raise ValueError(
            "sliding_window and use_cache=False do not apply to the serving engine "
            "(it always caches, within max_model_len)"
        )
    if not prompt_ids or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
        raise ValueError(
            f"the prompt must be a non-empty list of token ids in [0, {vocab}), got "
            f"{list(prompt_ids)[:8]}{'...' if len(prompt_ids) > 8 else ''}"
        )
    limit = engine_config.max_model_len
    new_tokens = 0 if options.prompt_only else config.max_new_tokens
    if len(prompt_ids) + new_tokens > limit:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
            f"({new_tokens}) exceed the model's context of {limit} tokens"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(options, name)
        if value is not None and not (isinstance(value, int) and 0 <= value <= vocab):
            raise ValueError(f"{name} must be an integer in [0, {vocab}], got {value!r}")
    if strategy == "beam" and (options.logprobs is not None or options.prompt_only):
        raise ValueError(
            f"num_beams={config.num_beams}: beam search reports no per-token "
            f"log-probabilities and always generates (logprobs and max_tokens=0 are not "
            f"served with it)"
        )
    for name in ("num_return_sequences", "num_beams"):
        if getattr(config, name) > engine_config.max_num_seqs:
            raise ValueError(
                f"{name}={getattr(config, name)} exceeds max_num_seqs={engine_config.max_num_seqs}"
            )
    per_beam = -(-(len(prompt_ids) + config.max_new_tokens) // engine_config.block_size)
    if strategy == "beam" and config.num_beams * per_beam > engine_config.num_blocks:
        raise ValueError(
            f"num_beams={config.num_beams} beams of up to {len(prompt_ids)} + "
            f"{config.max_new_tokens} tokens may need {config.num_beams * per_beam} KV "
            f"blocks (no sharing), more than the pool's num_blocks={engine_config.num_blocks}"
        )
    if config.stop_string_list and tokenizer is None:
        raise ValueError("stop strings need the engine to have a tokenizer")
    if config.seed is not None and not SEED_RANGE[0] <= config.seed < SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {config.seed}")
    if options.grammar is not None:
        if strategy == "beam":
            raise ValueError(
                f"num_beams={config.num_beams}: structured output (a grammar) is served "
                f"with greedy decoding and sampling, not beam search"
            )
        if tokenizer is None:
            raise ValueError("structured output needs the engine to have a tokenizer")
        grammars.check(options.grammar, list(config.eos_token_ids))
