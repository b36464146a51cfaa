"""Token-for-token parity with HF ``generate`` on random GPT-2s loaded into ``llmlab.models.GPT``.

Oracle: ``transformers.GPT2LMHeadModel.generate`` with the same settings. Exact equality of the
token ids is required (same shape, same padding), batch 1 and batched with left padding.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.decoding import GenerationConfig, HFModel, generate
from tests.decoding.tiny import common_tokens, hf_model, llmlab_model, prompts

MODELS = ["v100_e32_h2", "v300_e64_h4", "v1000_e48_h3"]


def assert_same(ref: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != HF {tuple(ref.shape)}"
    assert torch.equal(ours, ref), f"\nHF:\n{ref}\nllmlab:\n{ours}"


def run_both(name, ids, mask, model=None, **kw):
    hf = hf_model(name)
    ref = hf.generate(ids, attention_mask=mask, do_sample=kw.pop("do_sample", False), **kw)
    ours = generate(model or llmlab_model(name), ids, GenerationConfig(**kw), attention_mask=mask)
    return ref, ours


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_hf(name, batch):
    vocab = hf_model(name).config.vocab_size
    ids, mask = prompts(vocab, batch, 7, seed=batch, padded=batch > 1)
    eos = common_tokens(hf_model(name), ids, mask)
    for kw in (
        dict(max_new_tokens=12, pad_token_id=1),
        dict(max_new_tokens=12, pad_token_id=1, eos_token_id=eos),
        dict(max_new_tokens=12, pad_token_id=1, eos_token_id=eos[0], min_new_tokens=4),
        dict(max_new_tokens=12, pad_token_id=1, repetition_penalty=1.5, no_repeat_ngram_size=2),
    ):
        ref, ours = run_both(name, ids, mask, **kw)
        assert_same(ref, ours)
    # the stop really happened early for at least one row in the eos case
    ref, _ = run_both(name, ids, mask, max_new_tokens=12, pad_token_id=1, eos_token_id=eos)
    assert bool((ref[:, ids.shape[1] :] == 1).any()) or ref.shape[1] < ids.shape[1] + 12


@pytest.mark.parametrize("name", MODELS[:2])
@pytest.mark.parametrize("num_beams", [2, 3, 5])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_search_matches_hf(name, num_beams, early_stopping):
    vocab = hf_model(name).config.vocab_size
    for batch in (1, 3):
        ids, mask = prompts(vocab, batch, 6, seed=num_beams + batch, padded=batch > 1)
        eos = common_tokens(hf_model(name), ids, mask)
        for length_penalty in (1.0, 0.0, -0.7, 2.0):
            kw = dict(
                max_new_tokens=9,
                num_beams=num_beams,
                num_return_sequences=min(2, num_beams) if length_penalty != 0.0 else num_beams,
                early_stopping=early_stopping,
                length_penalty=length_penalty,
                eos_token_id=eos,
                pad_token_id=1,
            )
            ref, ours = run_both(name, ids, mask, **kw)
            assert_same(ref, ours)


def test_beam_search_with_penalties_matches_hf():
    ids, mask = prompts(100, 2, 6, seed=3)
    eos = common_tokens(hf_model(), ids, mask)
    kw = dict(
        max_new_tokens=10,
        num_beams=3,
        num_return_sequences=3,
        eos_token_id=eos,
        pad_token_id=1,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        min_new_tokens=3,
    )
    ref, ours = run_both("v100_e32_h2", ids, mask, **kw)
    assert_same(ref, ours)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_matches_hf_with_the_same_rng(seed):
    """Same processors, same order, same ``multinomial`` call: same samples from the same seed."""
    ids, mask = prompts(300, 3, 6, seed=seed)
    eos = common_tokens(hf_model("v300_e64_h4"), ids, mask)
    kw = dict(
        max_new_tokens=10,
        eos_token_id=eos,
        pad_token_id=1,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        num_return_sequences=2,
    )
    torch.manual_seed(seed)
    ref = hf_model("v300_e64_h4").generate(ids, attention_mask=mask, do_sample=True, **kw)
    torch.manual_seed(seed)
    ours = generate(
        llmlab_model("v300_e64_h4"),
        ids,
        GenerationConfig(do_sample=True, **kw),
        attention_mask=mask,
    )
    assert_same(ref, ours)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_hf_adapter_drives_hf_models_identically(num_beams):
    """``HFModel`` runs the HF model itself (and its DynamicCache) through llmlab's strategies."""
    ids, mask = prompts(100, 3, 6, seed=7)
    eos = common_tokens(hf_model(), ids, mask)
    kw = dict(max_new_tokens=10, num_beams=num_beams, eos_token_id=eos, pad_token_id=1)
    ref, ours = run_both("v100_e32_h2", ids, mask, model=HFModel(hf_model()), **kw)
    assert_same(ref, ours)
