"""Request preparation: a body parsed, checked and tokenized into prompts and
``GenerationConfig`` s before anything is queued -- the chat template rendered, the grammar of
``response_format`` or a forced ``tool_choice`` built, every bad value a 400 in the request's
own words."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request

from llmlab.decoding import GenerationConfig
from llmlab.serving.loading import encode
from llmlab.serving.openai_errors import APIError, BadRequest, parse
from llmlab.serving.protocol import ChatCompletionRequest, CompletionRequest
from llmlab.serving.structured import (
    json_object_grammar,
    json_schema_grammar,
    tool_call_format,
    tool_call_grammar,
)

if TYPE_CHECKING:
    from llmlab.serving.server_state import ServerState

# bodies up to this size are parsed and tokenized on the event loop (tens of microseconds; a
# thread hop costs more and reorders admission), larger ones in a worker thread
INLINE_BODY_BYTES = 16 * 2**10
# bodies that may carry a grammar always go to the thread: compiling and checking a schema can
# take milliseconds, and the first one builds the vocabulary's grammar tokenizer (~0.4 s for
# GPT-2's 50,257 ids)
GRAMMAR_FIELDS = (b'"response_format"', b'"tools"')
# GenerationConfig's field names as the OpenAI request spells them
RENAMED = {
    "min_new_tokens": "min_tokens",
    "max_new_tokens": "max_tokens",
    "num_return_sequences": "n",
    "stop_strings": "stop",
}


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with a 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(
        f"the request body exceeds the server's limit of {limit} bytes (--max-body-bytes)",
        status=413,
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def off_the_loop(prepare: Any, state: ServerState, raw: bytes) -> Any:
    """``prepare(state, raw)``: parse, tokenize and check a body; a large one (or one that may
    carry a grammar) in a worker thread, so that it never stalls the event loop (the streams of
    every other request)."""
    if len(raw) <= INLINE_BODY_BYTES and not any(f in raw for f in GRAMMAR_FIELDS):
        return prepare(state, raw)
    return await asyncio.to_thread(prepare, state, raw)


def prepare_completion(state: ServerState, raw: bytes) -> tuple[Any, list, list]:
    body = parse(CompletionRequest, raw)
    body._adapter = _check_model(state, body.model)
    body._grammar = _response_grammar(body)
    prompts = [_prompt_ids(state, p) for p in body.prompts()]
    limit = max(body.token_limit, 1)  # max_tokens=0 (echo): RequestOptions.prompt_only
    return body, prompts, [_config(state, body, ids, limit) for ids in prompts]


def prepare_chat(state: ServerState, raw: bytes) -> tuple[Any, list, list]:
    body = parse(ChatCompletionRequest, raw)
    body._adapter = _check_model(state, body.model)
    messages = [m.as_dict() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    body._grammar = _response_grammar(body) or _tool_grammar(state, body)
    try:
        text = state.chat_template.render(messages, body.add_generation_prompt, tools)
    except ValueError as err:
        raise BadRequest(str(err), "messages") from err
    ids = _prompt_ids(state, text)
    room = state.engine.config.max_model_len - len(ids)
    return body, [ids], [_config(state, body, ids, body.token_limit or max(room, 1))]


def _response_grammar(body: Any) -> str | None:
    """The grammar of ``response_format`` (None for none or ``text``); a schema that is not a
    JSON object is a 400 here, one llguidance cannot compile is one in ``_config``."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return json_object_grammar()
        return json_schema_grammar(fmt.json_schema.schema_)
    except ValueError as err:
        raise BadRequest(f"response_format: {err}", "response_format") from err


def _tool_grammar(state: ServerState, body: Any) -> str | None:
    """With tools: the template must render them; a forced choice (``required``, a named
    function) is the grammar of one call in the template's format (``required`` with
    ``parallel_tool_calls``: one or more, where the model has an end token to stop on)."""
    if not body.tools:
        return None
    fmt = tool_call_format(state.chat_template.source)
    if fmt is None:
        raise BadRequest(
            "tools: this model's chat template does not render tools (it never reads "
            "`tools`, or uses a tool-call format llmlab.serving does not parse: Hermes "
            "<tool_call> or Llama 3 JSON); serve it with --chat-template FILE of one that does",
            "tools",
        )
    forced = body.forced_tools
    if not forced:
        return None
    ends = bool(state.eos_token_ids) and not body.ignore_eos
    many = body.tool_choice_name == "required" and body.parallel_tool_calls and ends
    try:
        return tool_call_grammar(forced, fmt, many)
    except ValueError as err:
        raise BadRequest(f"tools: {err}", "tools") from err


def _check_model(state: ServerState, name: str) -> str | None:
    """The LoRA adapter ``name`` selects (vLLM's convention: an adapter is a model of its
    own), None for the base model; a 404 for a name that is neither."""
    if name == state.model_name:
        return None
    adapters = state.engine.adapters.names
    if name not in adapters:
        served = repr(state.model_name) + "".join(f", {a!r}" for a in adapters)
        raise APIError(
            f"the model {name!r} does not exist; this server serves {served}",
            "model",
            status=404,
            code="model_not_found",
            kind="model_not_found",
        )
    return name


def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send token ids as the prompt", "prompt")
        return encode(state.engine.tokenizer, prompt)
    return list(prompt)


def _config(state: ServerState, body: Any, ids: list[int], max_tokens: int) -> GenerationConfig:
    try:
        config = body.generation_config(max_tokens, state.eos_token_ids)
        state.engine.check_request("", ids, config, body.request_options())
    except ValueError as err:
        message = str(err).removeprefix("GenerationConfig: ")
        if message.startswith("invalid grammar"):  # llguidance's word on a schema
            field = body.grammar_field
            raise BadRequest(f"{field}: {message}", field) from err
        for ours, openai_name in RENAMED.items():  # say it in the request's own words
            message = message.replace(ours, openai_name)
        raise BadRequest(message) from err
    return config
