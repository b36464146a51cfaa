"""llmlab's logits processors against HF's ``LogitsProcessorList`` (oracle), tolerance 1e-6.

Scores come from a real (random) GPT-2 so they have a realistic spread, plus hand-made ties.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmlab.decoding import GenerationConfig, build_processors
from tests.decoding.tiny import hf_model, prompts


def scores_and_ids(batch: int = 4, length: int = 12, seed: int = 0):
    ids, mask = prompts(300, batch, length, seed=seed)
    # repeat some tokens so repetition / n-gram rules have something to act on
    ids[:, -4:] = ids[:, 2:6]
    with torch.no_grad():
        logits = hf_model("v300_e64_h4")(ids, attention_mask=mask).logits[:, -1].float()
    return ids, mask, logits


def distribution(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different tokens removed"
    torch.testing.assert_close(distribution(ours), distribution(ref), atol=1e-6, rtol=0)


CASES = [
    (dict(temperature=0.7, do_sample=True), lambda m, P: [TemperatureLogitsWarper(0.7)]),
    (dict(top_k=17, do_sample=True), lambda m, P: [TopKLogitsWarper(17)]),
    (dict(top_p=0.8, do_sample=True), lambda m, P: [TopPLogitsWarper(0.8)]),
    (dict(top_p=0.05, do_sample=True), lambda m, P: [TopPLogitsWarper(0.05)]),
    (dict(min_p=0.1, do_sample=True), lambda m, P: [MinPLogitsWarper(0.1)]),
    (
        dict(repetition_penalty=1.7),
        lambda m, P: [RepetitionPenaltyLogitsProcessor(1.7, (m != 0).int().argmax(1))],
    ),
    (dict(no_repeat_ngram_size=2), lambda m, P: [NoRepeatNGramLogitsProcessor(2)]),
    (dict(no_repeat_ngram_size=3), lambda m, P: [NoRepeatNGramLogitsProcessor(3)]),
    (
        dict(min_new_tokens=5, eos_token_id=[3, 7]),
        lambda m, P: [MinNewTokensLengthLogitsProcessor(P - 2, 5, torch.tensor([3, 7]))],
    ),
    (
        dict(
            do_sample=True,
            temperature=1.3,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.2,
            no_repeat_ngram_size=2,
        ),
        lambda m, P: [
            RepetitionPenaltyLogitsProcessor(1.2, (m != 0).int().argmax(1)),
            NoRepeatNGramLogitsProcessor(2),
            TemperatureLogitsWarper(1.3),
            TopKLogitsWarper(50),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ],
    ),
]


@pytest.mark.parametrize("fields,make_ref", CASES)
def test_processors_equal_hf(fields, make_ref):
    ids, mask, logits = scores_and_ids()
    P = ids.shape[1]
    prompt_len = P - 2 if "min_new_tokens" in fields else P
    ours = build_processors(GenerationConfig(**fields), prompt_len, mask)(ids, logits.clone())
    ref = LogitsProcessorList(make_ref(mask, P))(ids, logits.clone())
    assert_close(ours, ref)
    if fields.get("do_sample") is None and "repetition_penalty" not in fields:
        assert bool(torch.isinf(ours).any()), "the case should remove something"


def test_ties_and_beam_sampling_keep_enough_tokens():
    """Ties at the top-k boundary are kept; beam sampling keeps len(eos) + 1 tokens (as HF)."""
    scores = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0, 0.5]])
    ids = torch.zeros(1, 3, dtype=torch.long)
    cfg = GenerationConfig(do_sample=True, top_k=2)
    ours = build_processors(cfg, 3)(ids, scores.clone())
    ref = TopKLogitsWarper(2)(ids, scores.clone())
    assert_close(ours, ref)
    cfg = GenerationConfig(do_sample=True, top_p=0.01, num_beams=2, eos_token_id=[4, 5])
    ours = build_processors(cfg, 3)(ids, scores.clone())
    ref = TopPLogitsWarper(0.01, min_tokens_to_keep=3)(ids, scores.clone())
    assert_close(ours, ref)
    assert int(torch.isfinite(ours).sum()) >= 3


def test_documented_order_penalties_before_warpers():
    cfg = GenerationConfig(
        do_sample=True,
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        repetition_penalty=1.1,
        no_repeat_ngram_size=3,
        min_new_tokens=2,
        eos_token_id=0,
    )
    names = [type(p).__name__ for p in build_processors(cfg, 4)]
    assert names == [
        "RepetitionPenalty",
        "NoRepeatNGram",
        "MinNewTokens",
        "Temperature",
        "TopK",
        "TopP",
        "MinP",
    ]
    # greedy decoding gets no warpers
    names = [type(p).__name__ for p in build_processors(cfg.replace(do_sample=False), 4)]
    assert names == ["RepetitionPenalty", "NoRepeatNGram", "MinNewTokens"]
