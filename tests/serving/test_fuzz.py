"""Issue 40, Done-when 1: the server survives anything a client sends.

A seeded generator makes 2,400 random and adversarial request bodies -- valid bodies with one
field replaced by a wrong type, an extreme or non-finite number (``1e400``, ``NaN``, 2**64,
1e-300), a huge or empty value, unicode; unknown fields; random JSON documents; broken bytes
(truncated, not UTF-8, empty) -- for both endpoints, streamed or not, and sends them 24 at a time
to a real server on 127.0.0.1, with a normal greedy request for every 12 of them. Every
response must be a 200 (a stream without error events) or a 4xx with OpenAI's error body, the
normal requests' text must be ``llmlab.decoding.generate``'s exactly, ``/health`` must answer
200 throughout, and at the end every KV block must be free with every reference count zero.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import torch

from llmlab.decoding import GenerationConfig, generate
from llmlab.tokenizer import ByteTokenizer
from tests.serving.live import MODEL_NAME, LiveServer, byte_state
from tests.serving.models import byte_gpt

TOK = ByteTokenizer()
BODIES, CONCURRENCY, NORMAL_EVERY = 2400, 24, 12
MAX_BODY_BYTES = 256 * 1024

# JSON text spliced in where a value is "raw": numbers json.dumps cannot write
RAW = ["1e400", "-1e400", "NaN", "Infinity", "-0.0", "1e-400", "18446744073709551616",
       "1" + "0" * 400, "0.1e1", "1E2"]  # fmt: skip
UNICODE = ["", " ", "é", "😀", "\u0000", "\u202e", "\ufeff", "\U0010ffff", "🏳️‍🌈" * 20, "日本語",
           "a\nb\r\nc\t", "\\", '"', "<|endoftext|>"]  # fmt: skip
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed",
          "repetition_penalty", "no_repeat_ngram_size", "min_tokens", "ignore_eos", "num_beams",
          "length_penalty", "early_stopping", "user", "logprobs", "top_logprobs", "echo",
          "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "tools",
          "tool_choice", "response_format", "add_generation_prompt"]  # fmt: skip


def scalar(rng: random.Random):
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 2, 7, 16, 127, 128, 129, 4096, 2**31, 2**63, 2**64 - 1,
                           -(2**63), 10**30, -(10**30)])  # fmt: skip
    if kind == 2:
        return rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, -0.5, 1e-300, 1e300, 1e308, -1e308, 5e-324,
                           1e-7, 3.14, 100.0])  # fmt: skip
    if kind == 3:
        return rng.choice(UNICODE)
    if kind == 4:
        return "".join(rng.choice("ab ,.xyzé😀\n") for _ in range(rng.randint(1, 40)))
    if kind == 5:
        return f"@RAW{rng.randrange(len(RAW))}@"
    if kind == 6:
        return rng.choice(["yes", "true", "1", "inf", "nan", "-inf", "1e400", "never", "none"])
    if kind == 7:  # big
        return rng.choice(["x" * rng.choice([2000, 20000, 300000]), list(range(3000)),
                           [[1] * 200] * 50])  # fmt: skip
    return rng.choice([MODEL_NAME, "gpt-4", "", "tiny-bytes "])


def value(rng: random.Random, depth: int = 0):
    if depth < 3 and rng.random() < 0.25:
        if rng.random() < 0.5:
            return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice([*FIELDS[:6], "type", "text", "role", "content", "", "😀"]):
                value(rng, depth + 1) for _ in range(rng.randint(0, 4))}  # fmt: skip
    return scalar(rng)


def valid_body(rng: random.Random, chat: bool) -> dict:
    text = "".join(rng.choice("abcdefgh ,.") for _ in range(rng.randint(1, 20)))
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 12)}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text if rng.random() < 0.7 else TOK.encode(text)
    for name, make in [
        ("temperature", lambda: rng.choice([0, 0.7, 1.0, 1e-300, 1e300, 2])),
        ("top_p", lambda: rng.choice([0.1, 0.9, 1.0])),
        ("top_k", lambda: rng.choice([-1, 0, 1, 5, 10**30])),
        ("min_p", lambda: rng.choice([0.0, 0.5, 1.0])),
        ("repetition_penalty", lambda: rng.choice([1e-300, 0.5, 1.3, 1e300])),
        ("no_repeat_ngram_size", lambda: rng.choice([0, 1, 2, 10**9])),
        ("seed", lambda: rng.choice([0, -1, 2**63, 2**64 - 1, -(2**63)])),
        ("n", lambda: rng.choice([1, 2, 3])),
        ("stop", lambda: rng.choice(["a", ["b", "😀"], "\u0000"])),
        ("stream", lambda: rng.choice([True, False])),
        ("ignore_eos", lambda: True),
    ]:
        if rng.random() < 0.3:
            body[name] = make()
    if rng.random() < 0.15:  # log-probabilities (and the prompt's, with echo)
        if chat:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 1, 20]))
        else:
            body.update(logprobs=rng.choice([0, 1, 5, 20]), echo=rng.random() < 0.5)
            if body["echo"] and rng.random() < 0.3:
                body["max_tokens"] = 0
    if rng.random() < 0.1:
        body.update(num_beams=2, temperature=0, n=rng.choice([1, 2]),
                    length_penalty=rng.choice([-20.0, 0.0, 1.0, 20.0]))  # fmt: skip
    if body.get("stream") and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, raw body bytes) of one random or adversarial request."""
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = rng.random()
    if kind < 0.07:  # broken bytes
        good = json.dumps(valid_body(rng, chat)).encode()
        return path, rng.choice([good[: rng.randrange(len(good))], b"\xff\xfe" + good, b"",
                                 good.replace(b"{", b"{\x80", 1), b"\xef\xbb\xbf" + good,
                                 good + b" trailing", b"null", b"[]", b"{}"])  # fmt: skip
    if kind < 0.15:  # a random JSON document
        body = value(rng, 0)
    else:
        body = valid_body(rng, chat)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            field = rng.choice(FIELDS) if rng.random() < 0.95 else rng.choice(["beam_width", "😀"])
            if field in body and rng.random() < 0.15:
                del body[field]
            else:
                body[field] = value(rng)
        if chat and rng.random() < 0.2:
            body["messages"] = [{"role": scalar(rng), "content": value(rng),
                                 **({"name": value(rng)} if rng.random() < 0.3 else {})}
                                for _ in range(rng.randint(0, 3))]  # fmt: skip
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    for i, raw in enumerate(RAW):
        text = text.replace(f'"@RAW{i}@"', raw)
    return path, text.encode("utf-8", "surrogatepass")


def expected_text(prompt: str, max_tokens: int) -> str:
    ids = TOK.encode(prompt)
    out = generate(byte_gpt(), torch.tensor([ids]), GenerationConfig(max_new_tokens=max_tokens))
    return TOK.decode(out[0, len(ids) :].tolist())


def check_error(response: httpx.Response, raw: bytes) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300], raw[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error" and {"param", "code"} <= set(error), error


async def send(client: httpx.AsyncClient, path: str, raw: bytes) -> int:
    headers = {"content-type": "application/json"}
    async with client.stream("POST", path, content=raw, headers=headers) as r:
        data = await r.aread()
        if r.status_code != 200:
            check_error(r, raw)
            return r.status_code
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", (raw[:300], data[-300:])
            for event in events[:-1]:
                assert "error" not in json.loads(event), (raw[:300], event)
        else:
            assert json.loads(data)["choices"], raw[:300]
        return 200


async def normal(client: httpx.AsyncClient, rng: random.Random, seen: list) -> None:
    prompt = "".join(rng.choice("abcdefgh ,.") for _ in range(rng.randint(1, 16)))
    max_tokens = rng.randint(1, 12)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    seen.append((prompt, max_tokens, r.json()["choices"][0]["text"]))


async def fuzz(url: str) -> tuple[dict[int, int], list]:
    rng = random.Random(40)
    jobs = [fuzz_body(rng) for _ in range(BODIES)]
    codes: dict[int, int] = {}
    seen: list = []
    limits = httpx.Limits(max_connections=CONCURRENCY + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        for start in range(0, BODIES, CONCURRENCY):
            batch = jobs[start : start + CONCURRENCY]
            tasks = [send(client, path, raw) for path, raw in batch]
            tasks += [normal(client, rng, seen) for _ in range(len(batch) // NORMAL_EVERY)]
            for code in await asyncio.gather(*tasks):
                if code is not None:
                    codes[code] = codes.get(code, 0) + 1
            if start % (CONCURRENCY * 10) == 0:
                assert (await client.get("/health")).status_code == 200
    return codes, seen


def test_thousands_of_adversarial_bodies_get_200s_or_openai_4xxs_and_break_nothing():
    state = byte_state()
    state.max_body_bytes = MAX_BODY_BYTES
    with LiveServer(state) as live:
        codes, seen = asyncio.run(asyncio.wait_for(fuzz(live.url), timeout=600))
        assert httpx.get(f"{live.url}/health").status_code == 200
        live.wait_idle()
        blocks = live.state.engine.scheduler.blocks
        assert blocks.num_free == len(blocks.blocks) == live.state.engine.config.num_blocks
        assert all(b.ref_count == 0 for b in blocks.blocks)
        blocks.check([])
        errors = dict(live.state.engine.stats.errors_by_kind)
    assert sum(codes.values()) == BODIES and set(codes) <= {200, 400, 404, 413}, codes
    assert codes.get(200, 0) >= 100 and codes.get(400, 0) >= 1000, codes  # both kinds exercised
    assert not {k for k in errors if k not in {"invalid_request", "model_not_found",
                                               "body_too_large"}}, errors  # fmt: skip
    assert len(seen) == BODIES // NORMAL_EVERY
    print(f"fuzz: {codes}, normal requests {len(seen)}, errors by kind {errors}")
    for prompt, max_tokens, text in seen:
        assert text == expected_text(prompt, max_tokens), (prompt, max_tokens)
