"""Per-request decoding rules inside one batch, and the engine's refusals and cancellation.

Every request of a batch brings its own eos ids, stop strings, min_new_tokens and penalties;
each must come out as ``llmlab.decoding.generate`` decodes it alone (token-identical), with its
text equal to the decoded tokens, minus the eos token and cut before the stop string (OpenAI's
convention).
"""

from __future__ import annotations

import pytest
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.serving import EngineConfig, LLMEngine
from llmlab.tokenizer import ByteTokenizer
from tests.serving.models import byte_gpt

TOK = ByteTokenizer()
CONFIG = EngineConfig(block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)


def run(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def test_each_request_keeps_its_own_rules_in_a_shared_batch():
    model = byte_gpt()
    prompt = list(b"To be, or not")
    free_run = generate(model, torch.tensor([prompt]), max_new_tokens=30)[0, len(prompt) :].tolist()
    eos = free_run[6]  # a token greedy really emits: stops early
    stop = TOK.decode(free_run[9:11])  # a string it really produces, maybe across two tokens
    requests = {
        "plain": GenerationConfig(max_new_tokens=30),
        "eos": GenerationConfig(max_new_tokens=30, eos_token_id=[999, eos]),
        "min": GenerationConfig(max_new_tokens=30, eos_token_id=eos, min_new_tokens=12),
        "stop": GenerationConfig(max_new_tokens=30, stop_strings=[stop, "zzz"]),
        "penalised": GenerationConfig(max_new_tokens=30, repetition_penalty=1.5,
                                      no_repeat_ngram_size=2),
    }  # fmt: skip
    engine = LLMEngine(model, TOK, CONFIG)
    for rid, config in requests.items():
        engine.add_request(rid, prompt, config)
    done = run(engine)
    for rid, config in requests.items():
        alone = generate(model, torch.tensor([prompt]), config, tokenizer=TOK)
        tokens = alone[0, len(prompt) :].tolist()
        assert done[rid].token_ids == tokens, rid
        text = TOK.decode(tokens[:-1] if done[rid].finish_reason == "stop" and rid != "stop"
                          else tokens)  # fmt: skip
        if rid == "stop":
            text = text[: text.index(stop)]
        assert done[rid].text == text, rid
    assert len(done["eos"].token_ids) < 30 and done["eos"].finish_reason == "stop"
    assert len(done["min"].token_ids) >= 12 and done["stop"].finish_reason == "stop"
    assert done["plain"].finish_reason == "length"


def test_streamed_text_pieces_join_to_the_final_text():
    engine = LLMEngine(byte_gpt(), TOK, CONFIG)
    engine.add_request("s", list(b"ab"), GenerationConfig(max_new_tokens=40, do_sample=True,
                                                          seed=5))  # fmt: skip
    pieces, final = [], None
    while engine.has_unfinished:
        for out in engine.step():
            pieces.append(out.outputs[0].new_text)
            final = out.outputs[0]
    assert "".join(pieces) == final.text == TOK.decode(final.token_ids)


def test_abort_returns_every_block_at_once():
    engine = LLMEngine(byte_gpt(), TOK, CONFIG)
    engine.add_request("a", list(b"hello world"), GenerationConfig(max_new_tokens=50))
    engine.add_request("b", list(b"hello there"), GenerationConfig(max_new_tokens=50))
    for _ in range(5):
        engine.step()
    engine.abort("a")
    assert engine.stats.finished_by_reason == {"abort": 1}
    run(engine)
    blocks = engine.scheduler.blocks
    assert blocks.num_free == CONFIG.resolved(128).num_blocks
    assert all(b.ref_count == 0 for b in blocks.blocks)


@pytest.mark.parametrize(
    "prompt, config, message",
    [
        ([1] * 120, GenerationConfig(max_new_tokens=20), r"prompt \(120 tokens\) plus "
         r"max_new_tokens \(20\) exceed the model's context of 128"),
        ([1, 256], GenerationConfig(), r"token ids in \[0, 256\), got \[1, 256\]"),
        ([], GenerationConfig(), r"non-empty list of token ids"),
        ([1], GenerationConfig(num_beams=9), r"num_beams=9 exceeds max_num_seqs=8"),
        ([1], GenerationConfig(num_beams=2, do_sample=True), r"beam sampling \(num_beams=2"),
        ([1], GenerationConfig(temperature=0), r"temperature must be > 0"),
        ([1], GenerationConfig(sliding_window=8), r"sliding_window and use_cache=False"),
        ([1], GenerationConfig(do_sample=True, num_return_sequences=9),
         r"num_return_sequences=9 exceeds max_num_seqs=8"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_before_any_work(prompt, config, message):
    engine = LLMEngine(byte_gpt(), TOK, CONFIG)
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, config)
    assert not engine.has_unfinished and not engine.scheduler.has_work


def test_duplicate_ids_and_stop_strings_without_a_tokenizer_are_refused():
    engine = LLMEngine(byte_gpt(), None, CONFIG)
    engine.add_request("x", [1, 2], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        engine.add_request("x", [1, 2], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="stop strings need the engine to have a tokenizer"):
        engine.add_request("y", [1, 2], GenerationConfig(stop_strings="."))
