"""GenerationConfig: HF's field names and defaults, and clear errors for bad combinations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GenerationConfig as HFGenerationConfig

from llmlab.decoding import GenerationConfig, generate
from tests.decoding.tiny import llmlab_model


def test_field_names_exist_in_hf():
    hf = HFGenerationConfig()
    ours = {f.name for f in dataclasses.fields(GenerationConfig)}
    shared = ours - {
        "strategy",
        "num_assistant_tokens",
        "max_exhaustive_candidates",
        "seed",
        "sliding_window",  # llmlab's own: decoding past block_size by sliding the context
        "window_stride",
    }
    missing = [n for n in sorted(shared) if not hasattr(hf, n)]
    assert missing == [], f"fields HF does not know: {missing}"
    assert hasattr(hf, "num_assistant_tokens")
    # HF 5.x leaves most defaults as None and resolves them in generate; ours are explicit
    cfg = GenerationConfig()
    assert (cfg.num_beams, cfg.length_penalty, cfg.num_return_sequences) == (1, 1.0, 1)
    assert (cfg.temperature, cfg.top_p, cfg.repetition_penalty) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(min_new_tokens=30, max_new_tokens=5), "min_new_tokens"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences=3"),
        (dict(num_return_sequences=2), "num_return_sequences=2"),
        (dict(num_beams=0), "num_beams"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(eos_token_id=[1, -2]), "eos_token_id"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(strategy="magic"), "strategy"),
    ],
)
def test_invalid_configs_fail_with_the_value_named(fields, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(**fields).validate()


def test_generate_checks_inputs_before_work():
    model = llmlab_model()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="LongTensor"):
        generate(model, ids.float())
    with pytest.raises(ValueError, match="left padding"):
        generate(model, ids, attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="unknown GenerationConfig fields"):
        generate(model, ids, max_tokens=3)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ids, stop_strings=["\n"])
    with pytest.raises(ValueError, match="draft_model"):
        generate(model, ids, strategy="speculative")
