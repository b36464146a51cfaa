"""Log-probabilities: the engine's against HF's logits, and OpenAI's shapes over HTTP.

Oracle: ``log_softmax`` of HF's logits for the same prompt plus the generated tokens, on the
same random weights (GPT-2 and a grouped-query Llama). The engine computes them from the
logits of its own step (no second forward), for generated tokens and, on request, for every
prompt token (prefill keeps all its rows), in a pool small enough to chunk prompts and preempt
sequences, beside requests that fill the prefix cache with the same prefix. Over HTTP, the
`openai` client reads completions (``logprobs``, ``echo``, ``max_tokens: 0``) and chat
(``logprobs``, ``top_logprobs``), streamed and not.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from llmlab.decoding import GenerationConfig
from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.sequence import RequestOptions
from llmlab.tokenizer import ByteTokenizer
from tests.serving.engine_steps import PREFIX
from tests.serving.live import MODEL_NAME, LiveServer, byte_state
from tests.serving.models import byte_gpt, gpt_pair, hf_llama, llama, random_prompts

TOL = 1e-4


def run(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> dict[str, dict]:
    """Add ``arrivals[step]`` = [(id, prompt, config, options)] before each step; collect each
    request's tokens, log-probabilities, prompt log-probabilities and finish reasons."""
    got: dict[str, dict] = {}
    step = 0
    while engine.has_unfinished or any(k >= step for k in arrivals):
        for rid, prompt, config, options in arrivals.get(step, []):
            engine.add_request(rid, prompt, config, options)
            got[rid] = {"prompt": prompt, "tokens": {}, "logprobs": {}, "prompt_logprobs": None}
        for out in engine.step():
            assert out.error is None, out.error
            record = got[out.request_id]
            if out.prompt_logprobs is not None:
                assert record["prompt_logprobs"] is None  # reported once
                record["prompt_logprobs"] = out.prompt_logprobs
            for seq in out.outputs:
                record["tokens"].setdefault(seq.index, []).extend(seq.new_token_ids)
                record["logprobs"].setdefault(seq.index, []).extend(seq.new_logprobs)
                record["finish"] = seq.finish_reason
        step += 1
        assert step < 2000
    return got


def reference(hf, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position of ``ids`` (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check(logprob, ref_row: torch.Tensor, token: int, top: int) -> None:
    """One TokenLogprob against HF's log-softmax row: the token's value, the top-``top`` ids
    and values, best first, the token's own value where it is among them."""
    assert logprob.token_id == token
    assert abs(logprob.logprob - ref_row[token].item()) < TOL
    assert len(logprob.top) == top
    values = [v for _, v in logprob.top]
    assert values == sorted(values, reverse=True)
    want = ref_row.topk(top)
    assert [i for i, _ in logprob.top] == want.indices.tolist()
    assert all(abs(a - b) < TOL for a, b in zip(values, want.values.tolist()))
    for i, v in logprob.top:
        if i == token:
            assert v == logprob.logprob
    if top:
        assert logprob.logprob <= values[0] + 1e-6


def workload(vocab: int) -> dict[int, list[tuple]]:
    """Greedy and sampled requests with and without log-probabilities; requests 0 and 1 fill the
    prefix cache with PREFIX before 3 and 4 ask for their prompts' log-probabilities."""
    prompts = random_prompts(vocab, [9, 30, 5, 12, 7, 26, 3], seed=3)
    for i in (0, 1, 3, 4):
        prompts[i] = PREFIX + prompts[i]
    greedy = GenerationConfig
    sampled = GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.7, top_k=5, seed=5)
    both = RequestOptions(logprobs=5, prompt_logprobs=3)
    plan = [
        (0, greedy(max_new_tokens=12), RequestOptions()),
        (0, greedy(max_new_tokens=10), RequestOptions(logprobs=2)),
        (0, greedy(max_new_tokens=14), RequestOptions(logprobs=0)),
        (2, greedy(max_new_tokens=11), both),
        (2, greedy(max_new_tokens=1), RequestOptions(prompt_logprobs=1, prompt_only=True)),
        (3, sampled, both),  # values of the model's logits, not of the tempered top-5
        (5, greedy(max_new_tokens=8, num_return_sequences=1), both),  # a 3-token prompt
    ]
    arrivals: dict[int, list[tuple]] = {}
    for i, ((step, config, options), prompt) in enumerate(zip(plan, prompts)):
        arrivals.setdefault(step, []).append((f"r{i}", prompt, config, options))
    return arrivals


@pytest.mark.parametrize("pair", ["gpt", "llama"])
def test_logprobs_equal_log_softmax_of_hf_logits(pair):
    hf, model = gpt_pair() if pair == "gpt" else (hf_llama(), llama())
    # 12 blocks of 8 and 24 tokens a step: prompts are chunked, sequences preempted
    config = EngineConfig(block_size=8, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=24,
                          max_model_len=96)  # fmt: skip
    engine = LLMEngine(model, config=config)
    arrivals = workload(model.config.vocab_size)
    got = run(engine, arrivals)
    requests = {rid: (prompt, cfg, opt) for batch in arrivals.values()
                for rid, prompt, cfg, opt in batch}  # fmt: skip
    for rid, (prompt, cfg, options) in requests.items():
        record = got[rid]
        tokens = record["tokens"][0]
        ref = reference(hf, prompt + tokens)
        if not cfg.do_sample:  # greedy: HF's own tokens
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=cfg.max_new_tokens, pad_token_id=0)  # fmt: skip
            expected = [] if options.prompt_only else want[0, len(prompt) :].tolist()
            assert tokens == expected, rid
        logprobs = record["logprobs"][0]
        if options.logprobs is None:
            assert logprobs == [], rid
        else:
            assert len(logprobs) == len(tokens), rid
            for j, (lp, token) in enumerate(zip(logprobs, tokens)):
                check(lp, ref[len(prompt) + j - 1], token, options.logprobs)
        if options.prompt_logprobs is None:
            assert record["prompt_logprobs"] is None, rid
        else:
            first, *rest = record["prompt_logprobs"]
            assert first is None and len(rest) == len(prompt) - 1, rid
            for j, lp in enumerate(rest, start=1):
                check(lp, ref[j - 1], prompt[j], options.prompt_logprobs)
    assert got["r4"]["tokens"][0] == [] and got["r4"]["finish"] == "length"
    stats = engine.scheduler.blocks.stats()
    assert engine.scheduler.num_preemptions > 0 and stats.hits > 0  # both paths ran
    assert stats.free == stats.total


def test_prompt_logprobs_skip_a_warm_prefix_cache():
    """A cached block has no logits: a request that asks for its prompt's log-probabilities
    computes its whole prompt even when the cache holds its prefix; others still hit it."""
    hf, model = gpt_pair()
    engine = LLMEngine(model, config=EngineConfig(block_size=8, num_blocks=32, max_num_seqs=4))
    prompt = [*PREFIX, 7, 8, 9]
    greedy = GenerationConfig(max_new_tokens=3)
    run(engine, {0: [("warm", prompt, greedy, RequestOptions())]})
    hits = engine.scheduler.blocks.stats().hits
    got = run(engine, {0: [("echo", prompt, greedy, RequestOptions(prompt_logprobs=2))]})
    assert engine.scheduler.blocks.stats().hits == hits  # the cache was not used...
    ref = reference(hf, prompt)
    first, *rest = got["echo"]["prompt_logprobs"]
    assert first is None and len(rest) == len(prompt) - 1
    for j, lp in enumerate(rest, start=1):
        check(lp, ref[j - 1], prompt[j], 2)
    run(engine, {0: [("again", prompt, greedy, RequestOptions(logprobs=1))]})
    assert engine.scheduler.blocks.stats().hits == hits + 2  # ...though it held both blocks


def test_a_fault_computing_logprobs_ends_that_request_alone():
    tok = ByteTokenizer()
    config = EngineConfig(block_size=8, num_blocks=64, max_num_seqs=8, inject_fault="logprobs:BOOM")
    engine = LLMEngine(byte_gpt(), tok, config)
    greedy = GenerationConfig(max_new_tokens=6)
    engine.add_request("boom", tok.encode("BOOM here"), greedy, RequestOptions(logprobs=1))
    engine.add_request("boom-echo", tok.encode("BOOM"), greedy, RequestOptions(prompt_logprobs=1))
    engine.add_request("no-logprobs", tok.encode("BOOM too"), greedy)  # nothing to compute: served
    engine.add_request("fine", tok.encode("fine"), greedy, RequestOptions(logprobs=1))
    outs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["boom"].error.startswith("logprobs: injected fault")
    assert outs["boom-echo"].error.startswith("logprobs: injected fault")
    assert outs["no-logprobs"].error is None and outs["fine"].error is None
    assert len(outs["fine"].outputs[0].token_ids) == 6
    assert engine.stats.errors_by_kind == {"logprobs": 2}
    assert engine.scheduler.blocks.stats().used == 0


# ----------------------------------------------------------------- over HTTP
TOK = ByteTokenizer()


def model_logprobs(ids: list[int]) -> torch.Tensor:
    """The served model's log-softmax at every position (its plain training forward)."""
    with torch.no_grad():
        return torch.log_softmax(byte_gpt()(torch.tensor([ids]))[0].float(), dim=-1)


def piece(token: int) -> str:
    data = bytes([token])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return f"bytes:\\x{token:02x}"


@pytest.fixture(scope="module")
def live():
    with LiveServer(byte_state()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_completions_logprobs_with_echo(client, live):
    prompt = "To be, or not"
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                       temperature=0, logprobs=3, echo=True)  # fmt: skip
    (choice,) = answer.choices
    lp = choice.logprobs
    ids = TOK.encode(prompt)
    assert len(lp.tokens) == len(ids) + 6 == answer.usage.total_tokens
    generated = [TOK.encode(t)[0] if not t.startswith("bytes:") else int(t[-2:], 16)
                 for t in lp.tokens[len(ids) :]]  # fmt: skip
    ref = model_logprobs(ids + generated)
    assert choice.text.startswith(prompt)
    assert lp.tokens == [piece(t) for t in ids + generated]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))
    for j in range(1, len(ids) + 6):
        token = (ids + generated)[j]
        assert abs(lp.token_logprobs[j] - ref[j - 1, token].item()) < TOL
        top = lp.top_logprobs[j]
        best = ref[j - 1].topk(3)
        want = {piece(i): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        want.setdefault(piece(token), ref[j - 1, token].item())
        assert top.keys() == want.keys()
        assert all(abs(top[k] - want[k]) < TOL for k in want)
        if j >= len(ids):  # greedy: the chosen token is the most likely
            assert lp.token_logprobs[j] == max(top.values())
    # streamed: the same tokens and values, the echoed prompt in the first chunk
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                       temperature=0, logprobs=3, echo=True,
                                       stream=True)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    for key in ("tokens", "text_offset", "top_logprobs"):
        streamed = [x for c in chunks if c.choices[0].logprobs
                    for x in getattr(c.choices[0].logprobs, key)]  # fmt: skip
        if key == "top_logprobs":
            assert [t and t.keys() for t in streamed] == [t and t.keys() for t in lp.top_logprobs]
        else:
            assert streamed == getattr(lp, key), key
    streamed = [x for c in chunks if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed[0] is None
    assert all(abs(a - b) < TOL for a, b in zip(streamed[1:], lp.token_logprobs[1:]))
    live.wait_idle()


def test_echo_with_max_tokens_zero_scores_the_prompt(client, live):
    """What lm-eval's ``local-completions`` asks for a log-likelihood (it sends ``max_tokens:
    1`` and drops the last entry; OpenAI's documented form is ``max_tokens: 0``)."""
    ids = TOK.encode("Now is the winter of our discontent")
    answer = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=1)  # fmt: skip
    (choice,) = answer.choices
    assert choice.text == TOK.decode(ids) and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0
    ref = model_logprobs(ids)
    assert choice.logprobs.token_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[j] - ref[j - 1, ids[j]].item()) < TOL
        top = choice.logprobs.top_logprobs[j]
        is_greedy = choice.logprobs.token_logprobs[j] == max(top.values())
        assert is_greedy == (ref[j - 1].argmax().item() == ids[j])
    # n = 2: both choices echo the prompt; echo without logprobs returns the text alone
    two = client.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=0, echo=True, n=2,
                                    temperature=1, seed=1)  # fmt: skip
    assert [c.text for c in two.choices] == ["ab", "ab"] and two.choices[0].logprobs is None
    live.wait_idle()
    assert live.state.engine.scheduler.blocks.stats().used == 0


def test_chat_logprobs_and_top_logprobs(client, live):
    messages = [{"role": "user", "content": "Speak."}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                            temperature=0, logprobs=True,
                                            top_logprobs=4)  # fmt: skip
    (choice,) = answer.choices
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens == 8
    data = b"".join(bytes(entry.bytes) for entry in content)
    assert data.decode("utf-8", errors="replace") == choice.message.content
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=4,
                                            stream=True)  # fmt: skip
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content))
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                           temperature=0, logprobs=True)  # fmt: skip
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]
    live.wait_idle()


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(top_logprobs=2), "top_logprobs needs logprobs=true"),
        (dict(logprobs=True, top_logprobs=21), "less than or equal to 20"),
        (dict(logprobs=2), "Input should be a valid boolean"),
        (dict(response_format={"type": "json_objekt"}), "response_format.type"),
        (dict(tools=[{"type": "function"}]), "tools.0.function: Field required"),
    ],
)
def test_chat_refusals(live, body, message):
    full = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **body}
    answer = httpx.post(f"{live.url}/v1/chat/completions", json=full)
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]
