"""The OpenAI-compatible HTTP layer: FastAPI routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream: true``, ending in ``data: [DONE]``; ``stream_options.include_usage`` adds a
last chunk with the token counts), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text). Every handler checks its request completely -- body size, strict types,
model name, prompt length against the context, sampling values -- before it queues anything;
the body is parsed, tokenized and checked in a worker thread, never on the event loop. Every
error has OpenAI's error body, whatever its status: 400 for a bad request, 404 for an unknown
model (``model_not_found``) or route, 405, 413 for a body over ``max_body_bytes``, 500 for a
request the engine failed (``request_failed``, logged with its id; a stream gets an error
event instead) and 503 if the engine thread is gone. ``/metrics`` counts them by kind
(``llmlab_request_errors_total``). A client that disconnects (or stops reading a stream)
aborts its request, and its KV blocks return to the pool before the engine's next step.
Log-probabilities (``logprobs``, ``top_logprobs``, ``echo``) become the request's
``RequestOptions``; the engine's ``TokenLogprob`` s are shaped into OpenAI's objects here
(``llmlab.serving.logprobs``): completions' legacy object, chat's ``logprobs.content``.
Structured output (``llmlab.serving.structured``): ``response_format`` becomes a grammar (a
schema llguidance refuses is a 400 before anything is queued); chat ``tools`` are rendered by
the chat template, a forced ``tool_choice`` (``required`` or a named function) becomes a grammar
of the template's tool-call format, and the text of a request with tools is parsed into OpenAI
``tool_calls`` (``finish_reason: "tool_calls"``; a stream sends its content and calls at the
end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlab.decoding import GenerationConfig
from llmlab.serving.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from llmlab.serving.chat_template import ChatTemplate
from llmlab.serving.engine import LLMEngine, RequestOutput
from llmlab.serving.loading import encode
from llmlab.serving.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from llmlab.serving.protocol import ChatCompletionRequest, CompletionRequest, error_body
from llmlab.serving.sequence import TokenLogprob
from llmlab.serving.structured import (
    json_object_grammar,
    json_schema_grammar,
    parse_tool_calls,
    tool_call_format,
    tool_call_grammar,
)

log = logging.getLogger("llmlab.serving")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # --max-body-bytes
# bodies up to this size are parsed and tokenized on the event loop (tens of microseconds; a
# thread hop costs more and reorders admission), larger ones in a worker thread
INLINE_BODY_BYTES = 16 * 2**10
# bodies that may carry a grammar always go to the thread: compiling and checking a schema can
# take milliseconds, and the first one builds the vocabulary's grammar tokenizer (~0.4 s for
# GPT-2's 50,257 ids)
GRAMMAR_FIELDS = (b'"response_format"', b'"tools"')
# GenerationConfig's field names as the OpenAI request spells them
RENAMED = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens",
           "num_return_sequences": "n", "stop_strings": "stop"}  # fmt: skip
# HTTP status -> (the metric's error kind, OpenAI's error type) where nothing more precise says
KINDS = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
         413: "body_too_large", 500: "internal", 503: "engine_dead"}  # fmt: skip


class APIError(Exception):
    """An error answered with OpenAI's error body, ``status`` and a metric ``kind``."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
        self.kind = kind or KINDS.get(status, "invalid_request")


class BadRequest(APIError):
    """A 400 naming the field at fault."""


@dataclass
class ServerState:
    engine: LLMEngine
    model_name: str
    chat_template: ChatTemplate
    eos_token_ids: list[int] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    token_text: TokenText | None = None  # how log-probabilities name tokens (cached per id)

    def __post_init__(self) -> None:
        if self.token_text is None:
            self.token_text = TokenText(self.engine.tokenizer)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan."""
    async_engine = AsyncEngine(state.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="llmlab.serving", lifespan=lifespan)
    app.state.serving = state
    app.state.async_engine = async_engine

    def error(status: int, message: str, kind: str, param: str | None = None,
              code: str | None = None) -> JSONResponse:  # fmt: skip
        state.engine.stats.error(kind)
        kind_of_error = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, param, code, kind_of_error), status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error(err.status, str(err), err.kind, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err.errors())
        return error(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            err.status_code, str(err.detail))  # fmt: skip
        response = error(err.status_code, message, KINDS.get(err.status_code, "http"))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, err: RequestFailed) -> JSONResponse:
        log.error("request %s failed: %s", err.request_id, err)  # counted by the engine
        body = error_body(f"request {err.request_id} failed: {err}", None, "request_failed",
                          "server_error")  # fmt: skip
        return JSONResponse(body, 500)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, err: EngineDeadError) -> JSONResponse:
        return error(503, str(err), "engine_dead", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return error(500, f"internal error: {err!r}", "internal", code="internal_error")

    @app.get("/health")
    async def health() -> Any:
        if not async_engine.alive:
            return error(503, "the engine thread is not running", "engine_dead",
                         code="engine_dead")  # fmt: skip
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "llmlab",
            "max_model_len": state.engine.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.engine.stats.prometheus(), media_type="text/plain; version=0.0.4"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        raw = await read_body(request, state.max_body_bytes)
        body, prompts, configs = await off_the_loop(_prepare_completion, state, raw)
        fmt = CompletionFormat(state, body=body)
        return await _serve(async_engine, request, body, prompts, configs, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        raw = await read_body(request, state.max_body_bytes)
        body, prompts, configs = await off_the_loop(_prepare_chat, state, raw)
        tools = tool_call_format(state.chat_template.source) if body.tools_active else None
        fmt = ChatFormat(state, body=body, tool_format=tools)
        return await _serve(async_engine, request, body, prompts, configs, fmt)

    return app


# ------------------------------------------------------------------------ request checks
async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with a 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(f"the request body exceeds the server's limit of {limit} bytes "
                       f"(--max-body-bytes)", status=413)  # fmt: skip
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


def parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        message, param = validation_message(err.errors(include_input=False))
        raise BadRequest(message, param) from None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line for the first of pydantic's errors, and the field it names."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return f"the body is not valid JSON ({reason})", None
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), (where or None)


def _prepare_completion(state: ServerState, raw: bytes) -> tuple[Any, list, list]:
    body = parse(CompletionRequest, raw)
    _check_model(state, body.model)
    body._grammar = _response_grammar(body)
    prompts = [_prompt_ids(state, p) for p in body.prompts()]
    limit = max(body.token_limit, 1)  # max_tokens=0 (echo): RequestOptions.prompt_only
    return body, prompts, [_config(state, body, ids, limit) for ids in prompts]


def _prepare_chat(state: ServerState, raw: bytes) -> tuple[Any, list, list]:
    body = parse(ChatCompletionRequest, raw)
    _check_model(state, body.model)
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


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            "model", status=404, code="model_not_found", kind="model_not_found",
        )  # fmt: skip


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


# ------------------------------------------------------------------------ serving a request
async def _serve(
    async_engine: AsyncEngine,
    request: Request,
    body: Any,
    prompts: list[list[int]],
    configs: list[GenerationConfig],
    fmt: CompletionFormat,
) -> Any:
    rid = f"{fmt.prefix}-{uuid.uuid4().hex}"
    n = body.n
    options = body.request_options()
    streams = [
        async_engine.generate(f"{rid}-{i}", ids, config, options)
        for i, (ids, config) in enumerate(zip(prompts, configs))
    ]
    if body.stream:
        return StreamingResponse(
            _sse(fmt, rid, streams, n, prompts, body.include_usage),
            media_type="text/event-stream",
        )
    finals = await _until_done_or_disconnect(request, streams)
    return fmt.response(rid, finals, n, prompts)


@dataclass
class Final:
    """A request's last output, with the log-probabilities its outputs carried one step at a
    time: the prompt's, and every generated token's by sequence index."""

    output: RequestOutput
    prompt_logprobs: list[TokenLogprob | None] | None
    logprobs: dict[int, list[TokenLogprob]]


async def _until_done_or_disconnect(
    request: Request, streams: list[AsyncIterator[RequestOutput]]
) -> list[Final]:
    """The final output of every stream; abort them all if the client goes away first, or if
    one of them fails (the whole response is then that error)."""

    async def last(stream: AsyncIterator[RequestOutput]) -> Final:
        final, prompt_logprobs, logprobs = None, None, {}
        async for output in stream:
            final = output
            if output.prompt_logprobs is not None:
                prompt_logprobs = output.prompt_logprobs
            for seq in output.outputs:
                logprobs.setdefault(seq.index, []).extend(seq.new_logprobs)
        return Final(final, prompt_logprobs, logprobs)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    watch = asyncio.ensure_future(disconnected())
    await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if work.done() and work.exception() is None:
        return work.result()
    for task in tasks:  # closing the streams aborts their requests
        task.cancel()
    await asyncio.gather(work, *tasks, return_exceptions=True)
    if work.done() and not work.cancelled() and work.exception() is not None:
        raise work.exception()
    raise asyncio.CancelledError("client disconnected")


async def _sse(fmt: CompletionFormat, rid: str, streams: list, n: int, prompts: list[list[int]],
               include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """Merge the prompts' streams into one event stream (choice index = prompt * n + seq).
    A failed request ends the stream with an OpenAI error event (the status line is already
    sent) and ``[DONE]``; the other prompts' requests are aborted."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await merged.put((p, output))
        except Exception as err:  # reported in the stream
            await merged.put((p, err))
        await merged.put((p, None))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    completion_tokens = 0
    try:
        for chunk in fmt.first_chunks(rid, len(prompts) * n):
            yield _event(chunk)
        open_streams = len(streams)
        while open_streams:
            p, output = await merged.get()
            if output is None:
                open_streams -= 1
                continue
            if isinstance(output, Exception):
                log.error("request %s failed: %s", rid, output)
                code = "request_failed"  # counted by the engine, by stage
                if not isinstance(output, RequestFailed):
                    code = "internal_error"
                    fmt.state.engine.stats.error("internal")
                yield _event(error_body(f"request {rid} failed: {output}", None, code,
                                        "server_error"))  # fmt: skip
                break
            for seq in output.outputs:
                completion_tokens += len(seq.new_token_ids)
                chunk = fmt.chunk(rid, p, p * n + seq.index, seq, output)
                if chunk is not None:
                    yield _event(chunk)
        else:
            if include_usage:
                yield _event(fmt.usage_chunk(rid, usage(prompts, n, completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:  # the client left early: cancelling the pumps aborts the requests
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompts: list[list[int]], n: int, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ------------------------------------------------------------------------ response formats
@dataclass
class CompletionFormat:
    """``text_completion`` objects. With ``echo`` each choice's text starts with its prompt's
    text; with ``logprobs`` each choice has OpenAI's legacy ``logprobs`` object (the prompt's
    tokens first with ``echo``, the first with a null log-probability). A stream carries each
    new token's entries in the chunk of that token, the echoed prompt in a choice's first."""

    state: ServerState
    prefix: str = "cmpl"
    body: Any = None
    _offsets: dict[int, TextOffsets] = field(default_factory=dict)  # a stream's, by choice
    _echoed: set[int] = field(default_factory=set)  # a stream's choices that echoed their prompt

    def _base(self, rid: str) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.state.model_name}  # fmt: skip

    @property
    def _wants_logprobs(self) -> bool:
        return self.body is not None and self.body.logprobs is not None

    @property
    def _echo(self) -> bool:
        return self.body is not None and bool(getattr(self.body, "echo", False))

    def _prompt_text(self, p: int, prompt_ids: list[int]) -> str:
        prompt = self.body.prompts()[p]
        if isinstance(prompt, str):
            return prompt
        tok = self.state.engine.tokenizer
        return tok.decode(prompt_ids) if tok is not None else ""

    @staticmethod
    def _entries(
        prompt_ids: list[int] | None, prompt_logprobs: list | None, logprobs: list[TokenLogprob]
    ) -> list[tuple[int, TokenLogprob | None]]:
        entries: list[tuple[int, TokenLogprob | None]] = []
        if prompt_ids is not None:
            entries += zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids))
        return entries + [(lp.token_id, lp) for lp in logprobs]

    def response(self, rid: str, finals: list[Final], n: int, prompts) -> dict:
        choices, tokens = [], 0
        for p, final in enumerate(finals):
            prompt_text = self._prompt_text(p, prompts[p]) if self._echo else ""
            echoed = prompts[p] if self._echo else None
            for seq in sorted(final.output.outputs, key=lambda o: o.index):
                tokens += len(seq.token_ids)
                logprobs = None
                if self._wants_logprobs:
                    generated = final.logprobs.get(seq.index, [])
                    entries = self._entries(echoed, final.prompt_logprobs, generated)
                    logprobs = completion_logprobs(entries, self.state.token_text, TextOffsets())
                choices.append({"index": p * n + seq.index, "text": prompt_text + seq.text,
                                "logprobs": logprobs,
                                "finish_reason": seq.finish_reason})  # fmt: skip
        return {**self._base(rid), "choices": choices, "usage": usage(prompts, n, tokens)}

    def first_chunks(self, rid: str, choices: int) -> list[dict]:
        return []

    def chunk(self, rid: str, p: int, index: int, seq: Any, output: RequestOutput) -> dict | None:
        text, prompt_ids = seq.new_text, None
        if self._echo and index not in self._echoed:
            self._echoed.add(index)
            text = self._prompt_text(p, output.prompt_ids) + text
            prompt_ids = output.prompt_ids
        logprobs = None
        if self._wants_logprobs:
            entries = self._entries(prompt_ids, output.prompt_logprobs, seq.new_logprobs)
            if entries:
                offsets = self._offsets.setdefault(index, TextOffsets())
                logprobs = completion_logprobs(entries, self.state.token_text, offsets)
        if not text and logprobs is None and seq.finish_reason is None:
            return None
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": seq.finish_reason}  # fmt: skip
        return {**self._base(rid), "choices": [choice]}

    def usage_chunk(self, rid: str, counts: dict) -> dict:
        return {**self._base(rid), "choices": [], "usage": counts}


@dataclass
class ChatFormat(CompletionFormat):
    """``chat.completion`` and ``chat.completion.chunk`` objects; with ``logprobs: true`` each
    choice (each chunk, for its new tokens) has ``logprobs: {"content": [...]}``."""

    prefix: str = "chatcmpl"
    tool_format: str | None = None  # parse the text for tool calls in this format

    def _message(self, seq: Any) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish reason: its tool calls parsed out of its
        text when the request has tools (``finish_reason: "tool_calls"``)."""
        message: dict[str, Any] = {"role": "assistant", "content": seq.text}
        if self.tool_format is None or seq.finish_reason in (None, "error", "abort"):
            return message, seq.finish_reason
        content, calls = parse_tool_calls(seq.text, self.tool_format)
        if not calls:
            return message, seq.finish_reason
        message["content"] = content
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}
            for call in calls
        ]
        return message, "tool_calls"

    def _base(self, rid: str, chunk: bool = True) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": rid, "object": kind, "created": int(time.time()),
                "model": self.state.model_name}  # fmt: skip

    @property
    def _wants_logprobs(self) -> bool:
        return self.body is not None and bool(self.body.logprobs)

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not self._wants_logprobs:
            return None
        return {"content": chat_logprobs(logprobs, self.state.token_text)}

    def response(self, rid: str, finals: list[Final], n: int, prompts) -> dict:
        (final,) = finals
        choices, tokens = [], 0
        for seq in sorted(final.output.outputs, key=lambda o: o.index):
            tokens += len(seq.token_ids)
            logprobs = self._logprobs(final.logprobs.get(seq.index, []))
            message, finish_reason = self._message(seq)
            choices.append({"index": seq.index, "logprobs": logprobs, "message": message,
                            "finish_reason": finish_reason})  # fmt: skip
        return {**self._base(rid, chunk=False), "choices": choices,
                "usage": usage(prompts, n, tokens)}  # fmt: skip

    def _tool_chunk(self, rid: str, index: int, seq: Any, logprobs: Any) -> dict | None:
        if seq.finish_reason is None:
            if logprobs is None:
                return None
            choice = {"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None}
            return {**self._base(rid), "choices": [choice]}
        message, finish_reason = self._message(seq)
        delta: dict[str, Any] = {}
        if message["content"]:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call}
                                   for k, call in enumerate(message["tool_calls"])]  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        return {**self._base(rid), "choices": [choice]}

    def first_chunks(self, rid: str, choices: int) -> list[dict]:
        return [
            {**self._base(rid), "choices": [{"index": i, "logprobs": None, "finish_reason": None,
                                             "delta": {"role": "assistant", "content": ""}}]}
            for i in range(choices)
        ]  # fmt: skip

    def chunk(self, rid: str, p: int, index: int, seq: Any, output: RequestOutput) -> dict | None:
        logprobs = self._logprobs(seq.new_logprobs) if seq.new_logprobs else None
        if self.tool_format is not None:  # the text is parsed when it is whole: sent then
            return self._tool_chunk(rid, index, seq, logprobs)
        if not seq.new_text and logprobs is None and seq.finish_reason is None:
            return None
        delta = {"content": seq.new_text} if seq.new_text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": seq.finish_reason}  # fmt: skip
        return {**self._base(rid), "choices": [choice]}
