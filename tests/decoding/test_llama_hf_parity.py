"""Token-for-token parity with HF ``generate`` on random Llamas loaded into ``llmlab.models.Llama``.

Oracle: ``transformers.LlamaForCausalLM.generate`` (and Qwen2's, which adds q/k/v biases) with the
same settings, on models built from a config with random weights (nothing downloaded). Exact
equality of the token ids is required, batch 1 and batched with left padding, where RoPE must
take each row's positions from the attention mask. The models are grouped-query (4 query heads
share 2 KV heads) with an untied head, so the cache really holds fewer heads than attention
reads.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.utils import logging

from llmlab.decoding import GenerationConfig, HFModel, generate
from llmlab.models import Llama
from tests.decoding.tiny import common_tokens, prompts

logging.set_verbosity_error()
VOCAB = 200


@functools.cache
def hf_llama(arch: str = "Llama", kv_heads: int = 2) -> transformers.PreTrainedModel:
    """``initializer_range`` well above Llama's 0.02 makes next-token distributions peaked
    enough for eos ids to be hit and for beams to disagree."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        initializer_range=0.25,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return getattr(transformers, f"{arch}ForCausalLM")(config).eval()


@functools.cache
def llmlab_llama(arch: str = "Llama", kv_heads: int = 2) -> Llama:
    return Llama.from_hf(hf_llama(arch, kv_heads)).eval()


def assert_same(ref: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != HF {tuple(ref.shape)}"
    assert torch.equal(ours, ref), f"\nHF:\n{ref}\nllmlab:\n{ours}"


def run_both(ids, mask, arch="Llama", kv_heads=2, **kw):
    do_sample = kw.pop("do_sample", False)
    seed = kw.pop("seed", None)
    # both models built before seeding: building one draws random numbers (its init), which
    # would shift the samples whenever this test ran before any other had built them
    hf, ours_model = hf_llama(arch, kv_heads), llmlab_llama(arch, kv_heads)
    if seed is not None:
        torch.manual_seed(seed)
    ref = hf.generate(ids, attention_mask=mask, do_sample=do_sample, **kw)
    if seed is not None:
        torch.manual_seed(seed)
    config = GenerationConfig(do_sample=do_sample, **kw)
    ours = generate(ours_model, ids, config, attention_mask=mask)
    return ref, ours


@pytest.mark.parametrize(("arch", "kv_heads"), [("Llama", 2), ("Llama", 1), ("Qwen2", 2)])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_hf(arch, kv_heads, batch):
    ids, mask = prompts(VOCAB, batch, 7, seed=batch, padded=batch > 1)
    eos = common_tokens(hf_llama(arch, kv_heads), ids, mask)
    for kw in (
        dict(max_new_tokens=12, pad_token_id=1),
        dict(max_new_tokens=12, pad_token_id=1, eos_token_id=eos),
        dict(max_new_tokens=12, pad_token_id=1, repetition_penalty=1.5, no_repeat_ngram_size=2),
    ):
        assert_same(*run_both(ids, mask, arch, kv_heads, **kw))


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search_matches_hf(num_beams):
    ids, mask = prompts(VOCAB, 3, 6, seed=num_beams)
    eos = common_tokens(hf_llama(), ids, mask)
    for length_penalty, early_stopping in ((1.0, True), (-0.7, False), (2.0, "never")):
        kw = dict(
            max_new_tokens=9,
            num_beams=num_beams,
            num_return_sequences=2,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=1,
        )
        assert_same(*run_both(ids, mask, **kw))


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_matches_hf_with_the_same_rng(seed):
    ids, mask = prompts(VOCAB, 3, 6, seed=seed)
    eos = common_tokens(hf_llama(), ids, mask)
    kw = dict(
        max_new_tokens=10,
        eos_token_id=eos,
        pad_token_id=1,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        repetition_penalty=1.2,
        num_return_sequences=2,
    )
    assert_same(*run_both(ids, mask, do_sample=True, seed=seed, **kw))


def test_padded_rows_decode_like_unpadded_rows_and_like_the_hf_adapter():
    ids, mask = prompts(VOCAB, 4, 7, seed=2)
    cfg = GenerationConfig(max_new_tokens=8, pad_token_id=1)
    batched = generate(llmlab_llama(), ids, cfg, attention_mask=mask)
    for b in range(4):
        alone = generate(llmlab_llama(), ids[b : b + 1, mask[b].bool()], cfg)
        assert batched[b, ids.shape[1] :].tolist() == alone[0, int(mask[b].sum()) :].tolist()
    # the HF model driven through llmlab's own loop (HFModel + DynamicCache) agrees as well
    assert_same(generate(HFModel(hf_llama()), ids, cfg, attention_mask=mask), batched)


def test_speculative_greedy_with_a_gqa_cache_equals_greedy():
    """Speculative decoding crops the KV-heads-only cache on rejected drafts: the Llama target
    with a one-layer Llama draft (the target's first block, layer skipping) decodes the same
    tokens as plain greedy, batched with left padding."""
    import copy

    from llmlab.decoding import speculative_generate

    target = llmlab_llama()
    draft = copy.deepcopy(target)
    draft.blocks = draft.blocks[:1]
    draft.config.n_layer = 1
    ids, mask = prompts(VOCAB, 3, 6, seed=4)
    cfg = GenerationConfig(max_new_tokens=12, pad_token_id=1, num_assistant_tokens=3)
    plain = generate(target, ids, cfg, attention_mask=mask)
    assert torch.equal(generate(target, ids, cfg, attention_mask=mask, draft_model=draft), plain)
    _, stats = speculative_generate(target, draft, ids[1:2], cfg)
    assert stats.proposed > 0 and 0.0 <= stats.acceptance_rate < 1.0
