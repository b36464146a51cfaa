"""Done-when 2: the official ``openai`` client against a real server on 127.0.0.1.

The server (uvicorn, in a thread, on an OS-picked port) serves a random byte-level GPT; the
oracle for every greedy answer is ``llmlab.decoding.generate`` on the same prompt, decoded by the
same tokenizer. Streamed pieces must join to the non-streamed text, usage must count the
prompt's and the output's tokens, bad requests must get OpenAI-style 400s while the server
keeps serving, and a client that leaves mid-stream must get its request aborted and its KV
blocks freed.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from llmlab.decoding import GenerationConfig, generate
from llmlab.tokenizer import ByteTokenizer
from tests.serving.live import MODEL_NAME, LiveServer, byte_state
from tests.serving.models import byte_gpt

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def live():
    with LiveServer(byte_state()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy_text(prompt: str, max_tokens: int) -> tuple[str, int]:
    ids = TOK.encode(prompt)
    out = generate(byte_gpt(), torch.tensor([ids]), GenerationConfig(max_new_tokens=max_tokens))
    tokens = out[0, len(ids) :].tolist()
    return TOK.decode(tokens), len(tokens)


def test_completion_streamed_and_not_agree_with_generate(client):
    want, n = greedy_text("To be, or not to be", 24)
    whole = client.completions.create(model=MODEL_NAME, prompt="To be, or not to be",
                                      max_tokens=24, temperature=0)  # fmt: skip
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (19, n)
    assert whole.usage.total_tokens == 19 + n
    stream = client.completions.create(
        model=MODEL_NAME, prompt="To be, or not to be", max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_beam_search_returns_llmlab_decodings_n_best(client):
    ids = TOK.encode("To be, or not to be")
    config = GenerationConfig(max_new_tokens=12, num_beams=3, num_return_sequences=2)
    want = [TOK.decode(r[len(ids) :].tolist()) for r in generate(byte_gpt(), torch.tensor([ids]),
                                                                   config)]  # fmt: skip
    whole = client.completions.create(model=MODEL_NAME, prompt="To be, or not to be",
                                      max_tokens=12, n=2, extra_body={"num_beams": 3})  # fmt: skip
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
    assert whole.usage.completion_tokens == 24


def test_chat_streamed_and_not_agree_with_generate(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = "system: Be brief.\nuser: Hi\nassistant:"  # the plain template's rendering
    want, n = greedy_text(prompt, 16)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16,
                                           temperature=0)  # fmt: skip
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), n)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == len(prompt) + n


def test_n_sequences_with_a_seed_are_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt=["ab", "cd"], max_tokens=8, n=2, seed=7,
                  temperature=0.9)  # fmt: skip
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.prompt_tokens == 4 and first.usage.completion_tokens == 4 * 8


def test_models_health_and_metrics(client, live):
    client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)  # something to count
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{live.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("llmlab_num_requests_waiting", "llmlab_num_requests_running",
                 "llmlab_kv_blocks_used", "llmlab_generation_tokens_per_second",
                 "llmlab_time_to_first_token_seconds", "llmlab_generation_tokens"):  # fmt: skip
        assert name in families, name
    ttft = families["llmlab_time_to_first_token_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count >= 1
    # counters: typed families holding their `_total` samples (no untyped leftovers)
    assert not [f.name for f in families.values() if f.type == "unknown"]
    for name in ("prompt_tokens", "generation_tokens", "preemptions", "prefix_cache_hits",
                 "prefix_cache_queries", "request_success"):  # fmt: skip
        family = families[f"llmlab_{name}"]
        assert family.type == "counter" and family.samples, name
        assert {s.name for s in family.samples} == {f"llmlab_{name}_total"}
    assert families["llmlab_generation_tokens"].samples[0].value >= 2
    assert families["llmlab_prompt_tokens"].samples[0].value >= 1
    finished = {s.labels["finished_reason"]: s.value
                for s in families["llmlab_request_success"].samples}  # fmt: skip
    assert finished.get("length", 0) >= 1


BAD = [
    (dict(model=MODEL_NAME, prompt="hi", temperature=-0.5), "temperature", "greater than or equal"),
    (dict(model=MODEL_NAME, prompt="hi", max_tokens=500), None, "exceed the model's context"),
    (dict(model=MODEL_NAME, prompt="x" * 200, max_tokens=1), None, "prompt (200 tokens)"),
    (dict(model=MODEL_NAME, prompt="hi", logprobs=21), "logprobs", "less than or equal to 20"),
    (dict(model=MODEL_NAME, prompt="hi", max_tokens=0), None,
     "max_tokens=0 generates nothing: it is only allowed with echo=true"),
    (dict(model=MODEL_NAME, prompt="hi", logprobs=1, extra_body={"num_beams": 2}), None,
     "beam search reports no per-token log-probabilities"),
    (dict(model=MODEL_NAME, prompt="hi", presence_penalty=0.5), None,
     "presence_penalty=0.5 is not supported"),
    (dict(model=MODEL_NAME, prompt="hi", extra_body={"beam_width": 2}), "beam_width",
     "Extra inputs are not permitted"),
    (dict(model=MODEL_NAME, prompt="hi", n=2, temperature=0), None,
     "greedy decoding returns one sequence per prompt; n=2 needs do_sample"),
    (dict(model=MODEL_NAME, prompt="hi", best_of=3), None, "best_of=3 is not supported"),
    (dict(model=MODEL_NAME, prompt="hi", temperature=0.7, extra_body={"num_beams": 2}), None,
     "num_beams=2 is deterministic beam search"),
    (dict(model=MODEL_NAME, prompt="hi", max_tokens=4, extra_body={"min_tokens": 9}), None,
     "min_tokens must be an integer in [0, max_tokens=4], got 9"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, param, message", BAD)
def test_bad_requests_get_openai_style_400s(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and message in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_gets_a_400_and_the_server_keeps_serving(client, live):
    r = httpx.post(f"{live.url}/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=2).choices


def test_a_client_that_leaves_mid_stream_is_aborted_and_its_blocks_freed(live):
    engine = live.state.engine
    aborted = engine.stats.finished_by_reason.get("abort", 0)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 110,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one event, then hang up
    live.wait_idle()
    assert engine.stats.finished_by_reason.get("abort", 0) == aborted + 1
    assert engine.scheduler.blocks.num_free == engine.config.num_blocks
    assert all(b.ref_count == 0 for b in engine.scheduler.blocks.blocks)
