"""Issue 40, isolation: a fault while serving one request ends that request and nothing else.

Faults are injected (``EngineConfig.inject_fault``, ``llmlab.serving.faults``) into one request
at each stage -- its logits processing, its sampling, its detokenizing -- while other requests
share its steps: it alone ends with an error, the others decode token for token as
``llmlab.decoding.generate`` decodes them alone, and every KV block comes back. A fault in the
batched forward fails the requests of that step and the engine serves the next ones. Values that
used to kill the engine thread (a temperature or repetition penalty of 1e-300, a length penalty
whose power overflows, a seed of 2**64) are served or refused, never fatal; a model whose
embedding is padded past the tokenizer's vocabulary never samples a padding id (parity with HF
``generate`` given ``suppress_tokens`` over those ids).
"""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from llmlab.decoding import GenerationConfig, generate
from llmlab.models import GPT
from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate
from llmlab.serving.server import ServerState
from llmlab.tokenizer import ByteTokenizer
from tests.serving.live import MODEL_NAME, LiveServer, byte_state
from tests.serving.models import byte_gpt

TOK = ByteTokenizer()
CONFIG = dict(block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)


def engine_with(fault: str | None = None, model=None, tokenizer=TOK) -> LLMEngine:
    return LLMEngine(model or byte_gpt(), tokenizer, EngineConfig(**CONFIG, inject_fault=fault))


def run(engine: LLMEngine, steps: int | None = None, done: dict | None = None) -> dict:
    """Step until every request is done (or ``steps`` times); the finished outputs by id."""
    done = {} if done is None else done
    while engine.has_unfinished and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def alone(prompt: bytes, config: GenerationConfig) -> list[int]:
    ids = list(prompt)
    return generate(byte_gpt(), torch.tensor([ids]), config)[0, len(ids) :].tolist()


def all_blocks_free(engine: LLMEngine) -> bool:
    blocks = engine.scheduler.blocks
    return blocks.num_free == engine.config.num_blocks and all(
        b.ref_count == 0 for b in blocks.blocks
    )


OTHERS = {
    "greedy": (b"To be, or not", GenerationConfig(max_new_tokens=20)),
    "sampled": (
        b"hello",
        GenerationConfig(
            max_new_tokens=16, do_sample=True, seed=3, top_k=20, repetition_penalty=1.2
        ),
    ),
    "late": (b"abcdef", GenerationConfig(max_new_tokens=12)),
}


@pytest.mark.parametrize("stage", ["logits", "sampling", "detokenize"])
@pytest.mark.parametrize("faulty", ["greedy", "sampled", "beam"])
def test_a_fault_in_one_request_ends_it_alone(stage, faulty):
    engine = engine_with(f"{stage}:BOOM")
    config = {
        "greedy": GenerationConfig(max_new_tokens=20),
        "sampled": GenerationConfig(max_new_tokens=20, do_sample=True, seed=1),
        "beam": GenerationConfig(max_new_tokens=10, num_beams=2),
    }[faulty]
    engine.add_request("ok-greedy", list(OTHERS["greedy"][0]), OTHERS["greedy"][1])
    engine.add_request("bad", list(b"BOOM here"), config)
    engine.add_request("ok-sampled", list(OTHERS["sampled"][0]), OTHERS["sampled"][1])
    done = run(engine, steps=3)  # the faulty request may be mid-flight when another arrives
    engine.add_request("ok-late", list(OTHERS["late"][0]), OTHERS["late"][1])
    done = run(engine, done=done)
    assert done["bad"].error.startswith(f"{stage}: ") and "injected fault" in done["bad"].error
    assert all(o.finish_reason == "error" for o in done["bad"].outputs)
    for name, (prompt, cfg) in OTHERS.items():
        out = done[f"ok-{name}"]
        assert out.error is None and out.outputs[0].token_ids == alone(prompt, cfg), name
    assert all_blocks_free(engine)
    assert engine.stats.errors_by_kind == {stage: 1}


def test_a_fault_in_the_batched_forward_fails_that_step_and_the_engine_serves_on():
    engine = engine_with("forward:BOOM")
    engine.add_request("a", list(b"first"), GenerationConfig(max_new_tokens=8))
    for _ in range(2):
        engine.step()
    engine.add_request("b", list(b"second"), GenerationConfig(max_new_tokens=8))
    engine.add_request("bad", list(b"BOOM"), GenerationConfig(max_new_tokens=8))
    failed = {o.request_id: o for o in engine.step()}  # a, b and bad share this forward
    assert set(failed) == {"a", "b", "bad"}
    assert all(o.finished and o.error.startswith("forward: ") for o in failed.values())
    assert not engine.has_unfinished and all_blocks_free(engine)
    engine.add_request("next", list(b"next one"), GenerationConfig(max_new_tokens=10))
    done = run(engine)
    assert done["next"].error is None
    assert done["next"].outputs[0].token_ids == alone(
        b"next one", GenerationConfig(max_new_tokens=10)
    )
    assert engine.stats.errors_by_kind == {"forward": 3}


EXTREME = [
    GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1e-300, seed=0),
    GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1e300, seed=0),
    GenerationConfig(max_new_tokens=8, do_sample=True, repetition_penalty=1e-300, seed=0),
    GenerationConfig(max_new_tokens=8, repetition_penalty=1e300),
    GenerationConfig(max_new_tokens=8, do_sample=True, seed=2**64 - 1, num_return_sequences=3),
    GenerationConfig(max_new_tokens=8, do_sample=True, seed=-(2**63)),
    GenerationConfig(max_new_tokens=8, do_sample=True, top_k=10**30, min_p=1.0, seed=1),
    GenerationConfig(max_new_tokens=8, num_beams=2, length_penalty=-20.0),
    GenerationConfig(max_new_tokens=8, no_repeat_ngram_size=1),
]


def test_extreme_admitted_values_are_served_not_fatal():
    engine = engine_with()
    for i, config in enumerate(EXTREME):
        engine.add_request(f"x{i}", list(b"hello hello"), config)
    engine.add_request("plain", list(b"To be"), GenerationConfig(max_new_tokens=12))
    done = run(engine)
    assert all(out.error is None for out in done.values()), {k: o.error for k, o in done.items()}
    assert done["plain"].outputs[0].token_ids == alone(
        b"To be", GenerationConfig(max_new_tokens=12)
    )
    # a vanishing temperature is greedy's choice
    assert done["x0"].outputs[0].token_ids == alone(
        b"hello hello", GenerationConfig(max_new_tokens=8)
    )
    assert all_blocks_free(engine)


def test_a_seed_outside_torchs_range_is_refused_and_choice_seeds_never_collide():
    engine = engine_with()
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
        engine.add_request("big", [1, 2], GenerationConfig(do_sample=True, seed=2**64))
    sample = dict(max_new_tokens=24, do_sample=True)
    engine.add_request(
        "42", list(b"ab"), GenerationConfig(**sample, seed=42, num_return_sequences=2)
    )
    engine.add_request("43", list(b"ab"), GenerationConfig(**sample, seed=43))
    done = run(engine)
    first, second = (o.token_ids for o in sorted(done["42"].outputs, key=lambda o: o.index))
    assert second != done["43"].outputs[0].token_ids  # seed + i would make them equal
    assert first == alone(b"ab", GenerationConfig(**sample, seed=42))  # choice 0: the seed itself


def test_the_triton_backend_is_refused_at_startup_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the Triton backend runs here")
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        LLMEngine(byte_gpt(), TOK, EngineConfig(**CONFIG, attention_backend="triton"))


# ----------------------------------------------------------------- a vocabulary padded past
PAD_VOCAB = 300  # the byte tokenizer decodes ids 0..256; 257..299 are padding rows


def padded_pair() -> tuple[transformers.GPT2LMHeadModel, GPT]:
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=PAD_VOCAB, n_positions=128, n_embd=32, n_layer=2,
                                     n_head=2, initializer_range=0.3, bos_token_id=None,
                                     eos_token_id=None)  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    return hf, GPT.from_hf_gpt2(hf).eval()


HF_SETTINGS = dict(top_k=0, top_p=1.0, pad_token_id=0, suppress_tokens=list(range(257, PAD_VOCAB)))


def hf_generate(hf, prompt: list[int], max_new: int, **sampling) -> list[int]:
    ids = torch.tensor([prompt])
    if "seed" in sampling:
        torch.manual_seed(sampling.pop("seed"))
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      min_new_tokens=max_new, **{**HF_SETTINGS, **sampling})  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_ids_the_tokenizer_cannot_decode_are_never_sampled_as_hf_suppress_tokens():
    hf, model = padded_pair()
    prompts = [list(b"Hello"), list(b"a b c d"), list(b"To be, or not to be")]
    free = GenerationConfig(max_new_tokens=40, do_sample=True, temperature=1.3, seed=0)
    unmasked = [generate(model, torch.tensor([p]), free)[0, len(p) :].tolist() for p in prompts]
    assert any(t >= 257 for row in unmasked for t in row)  # without the mask, padding is chosen
    engine = LLMEngine(model, TOK, EngineConfig(**CONFIG))
    # id 256 decodes (to nothing: the byte tokenizer's end-of-document id); 257.. do not
    assert engine.suppressed.tolist() == list(range(257, PAD_VOCAB))
    sampled = dict(do_sample=True, temperature=1.3)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, GenerationConfig(max_new_tokens=40))
        engine.add_request(f"s{i}", p, GenerationConfig(max_new_tokens=40, **sampled, seed=i))
    done = run(engine)
    for i, p in enumerate(prompts):
        assert done[f"g{i}"].outputs[0].token_ids == hf_generate(hf, p, 40, do_sample=False)
        want = hf_generate(hf, p, 40, **sampled, seed=i)
        assert done[f"s{i}"].outputs[0].token_ids == want
        assert all(t < 257 for t in want) and done[f"s{i}"].outputs[0].text == TOK.decode(want)


def test_a_padded_model_serves_over_http():
    _, model = padded_pair()
    state = ServerState(LLMEngine(model, TOK, EngineConfig(**CONFIG)), MODEL_NAME,
                        ChatTemplate(PLAIN_TEMPLATE))  # fmt: skip
    with LiveServer(state) as live:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 60, "temperature": 1.5,
                "n": 4, "seed": 5}  # fmt: skip
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        assert httpx.get(f"{live.url}/health").status_code == 200


# ----------------------------------------------------------------- over HTTP
def error_counts(metrics_text: str) -> dict[str, float]:
    """``llmlab_request_errors_total`` by kind (the samples of ``llmlab_request_errors``)."""
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == "llmlab_request_errors_total"
    }


@pytest.fixture(scope="module")
def faulty_server():
    with LiveServer(byte_state(inject_fault="sampling:BOOM")) as live:
        yield live


def test_a_failed_request_gets_an_openai_error_and_others_their_answers(faulty_server):
    url = f"{faulty_server.url}/v1/completions"
    good = {"model": MODEL_NAME, "prompt": "To be, or not", "max_tokens": 20, "temperature": 0}
    bad = {**good, "prompt": "BOOM", "temperature": 0.8}
    with httpx.Client(timeout=60) as client:
        r = client.post(url, json=bad)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "request_failed"
        assert "injected fault at the sampling stage" in error["message"]
        events = []
        with client.stream("POST", url, json={**bad, "stream": True}) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"request_failed"' in events[-2]
        r = client.post(url, json=good)
        assert r.status_code == 200
        want = TOK.decode(alone(b"To be, or not", GenerationConfig(max_new_tokens=20)))
        assert r.json()["choices"][0]["text"] == want
        assert client.get(f"{faulty_server.url}/health").status_code == 200
        text = client.get(f"{faulty_server.url}/metrics").text
    faulty_server.wait_idle()
    assert all_blocks_free(faulty_server.state.engine)
    errors = error_counts(text)
    assert errors["sampling"] == 2


ERRORS = [
    ("GET", "/v1/nothing", None, 404, "no route GET /v1/nothing"),
    ("GET", "/v1/completions", None, 405, "GET is not allowed on /v1/completions"),
    ("POST", "/v1/completions", b'{"model": "\xff"}', 400, "not valid JSON"),
    ("POST", "/v1/completions", b"", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "Input should be an object"),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "'gpt-4' does not exist"),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user"}]}, 404,
     "does not exist"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": True}, 400,
     "max_tokens: Input should be a valid integer"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "stream": "yes"}, 400,
     "stream: Input should be a valid boolean"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "temperature": "inf"}, 400,
     "temperature: Input should be a valid number"),
    ("POST", "/v1/completions", b'{"model": "tiny-bytes", "prompt": "a", "temperature": 1e400}',
     400, "temperature: Input should be a finite number"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "seed": 2**64}, 400,
     "seed: Input should be less than or equal to"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "length_penalty": 1e308},
     400, "length_penalty: Input should be less than or equal to 20"),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "a" * 5000}, 413,
     "exceeds the server's limit of 4096 bytes"),
]  # fmt: skip


def test_every_error_has_the_openai_shape_and_is_counted():
    state = byte_state()
    state.max_body_bytes = 4096
    with LiveServer(state) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        for method, path, body, status, message in ERRORS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.request(method, path, **(kwargs if body is not None else {}))
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and message in error["message"], error
        text = client.get("/metrics").text
    errors = error_counts(text)
    assert errors == {"not_found": 1, "method_not_allowed": 1, "invalid_request": 9,
                      "model_not_found": 2, "body_too_large": 1}  # fmt: skip
