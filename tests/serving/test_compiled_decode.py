"""``EngineConfig.compile``: decode-only steps through the compiled forward
(``llmlab.serving.compiled_decode``) give the eager engine's tokens, exactly.

The exactness workload (preemption and recomputation, prefix-cache hits, a fork with
copy-on-write, requests arriving mid-run) on GPT-2, a grouped-query Llama and a Llama with
latent attention (one pool tensor for keys and values), with
``max_num_seqs=6``: buckets 1, 2, 4 and 6, so steps of 3 and 5 sequences run padded. Oracle:
the eager engine on the same workload (itself equal to ``generate`` and HF, see
test_engine_exactness.py). Greedy, token-identical; and the compiled path really ran.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.models import Llama, LlamaConfig
from llmlab.serving import EngineConfig, LLMEngine
from tests.serving.engine_steps import beam_arrivals, drive, small_engine, workload
from tests.serving.models import gpt_pair, llama


def _counting(compiled) -> list[int]:
    """Count the compiled forward's calls, by batch rows."""
    rows: list[int] = []
    forward = compiled.forward

    def counted(input_ids, **kwargs):
        rows.append(input_ids.shape[1])
        return forward(input_ids, **kwargs)

    compiled.forward = counted
    return rows


def latent_llama() -> Llama:
    """Multi-head latent attention (DeepSeek's, dense MLP): the pool keeps one latent per token,
    handed over as both keys and values."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=200, block_size=128, n_layer=2, n_head=4, n_kv_head=4,
                         n_embd=48, intermediate_size=80, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8)  # fmt: skip
    model = Llama(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)  # peaked next-token distributions: no near-ties
    return model


@pytest.mark.parametrize("which", ["gpt", "llama", "latent"])
def test_compiled_decode_steps_give_the_eager_engines_tokens(which):
    model = {"gpt": lambda: gpt_pair()[1], "llama": llama, "latent": latent_llama}[which]()
    arrivals = workload(model.config.vocab_size)
    want = drive(small_engine(model), arrivals)
    engine = small_engine(model, compile=True)
    assert engine.runner.compiled.buckets == [1, 2, 4, 6]
    pool = engine.runner.pool
    assert (pool.values[0] is pool.keys[0]) == (which == "latent")
    rows = _counting(engine.runner.compiled)
    assert drive(engine, arrivals) == want
    assert {1, 2, 4, 6} <= set(rows)  # every bucket ran, padded steps among them
    stats = engine.scheduler.blocks.stats()
    assert engine.scheduler.num_preemptions > 0 and stats.hits > 0 and stats.copies > 0


def test_compile_is_checked_up_front():
    with pytest.raises(ValueError, match="compile='yes'; valid: True or False"):
        EngineConfig(compile="yes").validate()
    # refused before the adapter is read or the model touched
    with pytest.raises(ValueError, match="compile=True with LoRA adapters"):
        LLMEngine(gpt_pair()[1], config=EngineConfig(compile=True), adapters={"a": "no/such"})
    moe = Llama(LlamaConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=16,
                            intermediate_size=24, num_experts=4))  # fmt: skip
    with pytest.raises(ValueError, match="mixture-of-experts layers"):
        LLMEngine(moe, config=EngineConfig(compile=True))
    with pytest.raises(ValueError, match="mixture-of-experts layers"):  # a draft compiles too
        LLMEngine(gpt_pair()[1], config=EngineConfig(compile=True, speculative="draft"),
                  draft_model=moe)  # fmt: skip


def test_the_server_flag_sets_it():
    from llmlab.serving.__main__ import engine_config, parse_args

    assert engine_config(parse_args(["model", "--compile"])).compile is True
    assert engine_config(parse_args(["model"])).compile is False


@pytest.mark.parametrize(
    "config",
    [
        dict(quantize="int8", kv_cache_dtype="bfloat16"),
        dict(speculative="ngram", num_speculative_tokens=3),
    ],
    ids=["int8-weights-bf16-pool", "ngram-speculation"],
)
def test_compiled_decode_beside_other_engine_options(config):
    """Quantized products (their own custom op in the graph) over a bf16 pool, and speculative
    steps (verification eager, the rest compiled): the eager engine's tokens with the same
    options."""
    arrivals = workload(300)
    want = drive(small_engine(copy.deepcopy(gpt_pair()[1]), **config), arrivals)
    engine = small_engine(copy.deepcopy(gpt_pair()[1]), compile=True, **config)
    rows = _counting(engine.runner.compiled)
    assert drive(engine, arrivals) == want
    assert rows  # some steps were compiled ones


def test_compiled_decode_under_beam_search():
    """Beam steps (forks, copy-on-write of partial blocks, parked beams) next to plain requests,
    with buckets up to 8: the eager engine's beams and tokens."""

    def engine(**config) -> LLMEngine:
        return LLMEngine(gpt_pair()[1], config=EngineConfig(
            block_size=4, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=32,
            max_model_len=48, **config))  # fmt: skip

    compiled = engine(compile=True)
    rows = _counting(compiled.runner.compiled)
    assert drive(compiled, beam_arrivals()) == drive(engine(), beam_arrivals())
    assert max(rows) == 8  # a padded step of the largest bucket ran


def test_compiled_decode_with_a_draft_model():
    """Draft-model speculation (the int8 self-draft): the draft's own runner compiles its
    decode steps too (a second model's graphs beside the target's); tokens equal the eager
    engine's with the same draft."""

    def engine(**config) -> LLMEngine:
        model = gpt_pair()[1]
        return LLMEngine(copy.deepcopy(model), draft_model=copy.deepcopy(model),
                         config=EngineConfig(block_size=8, num_blocks=40, max_num_seqs=6,
                                             max_num_batched_tokens=32, max_model_len=112,
                                             speculative="draft", draft_quantize="int8",
                                             num_speculative_tokens=3, **config))  # fmt: skip

    arrivals = workload(300)
    compiled = engine(compile=True)
    draft_rows = _counting(compiled.speculator.draft.runner.compiled)
    assert drive(compiled, arrivals) == drive(engine(), arrivals)
    assert draft_rows  # the draft proposed through its compiled steps
    assert compiled.speculator.drafted_steps > 0
