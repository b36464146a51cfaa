"""The OpenAI-compatible HTTP layer: FastAPI routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream: true``, ending in ``data: [DONE]``; ``stream_options.include_usage`` adds a
last chunk with the token counts), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text). Every handler checks its request completely -- body, model name, prompt
length against the context, sampling values -- before it queues anything, and answers a bad
one with a 400 and OpenAI's error body; the engine keeps serving everyone else. A client that
disconnects (or stops reading a stream) aborts its request, and its KV blocks return to the
pool before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from llmlab.decoding import GenerationConfig
from llmlab.serving.async_engine import AsyncEngine, EngineDeadError
from llmlab.serving.chat_template import ChatTemplate
from llmlab.serving.engine import LLMEngine, RequestOutput
from llmlab.serving.loading import encode
from llmlab.serving.protocol import ChatCompletionRequest, CompletionRequest, error_body

# GenerationConfig's field names as the OpenAI request spells them
RENAMED = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens",
           "num_return_sequences": "n", "stop_strings": "stop"}  # fmt: skip


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ServerState:
    engine: LLMEngine
    model_name: str
    chat_template: ChatTemplate
    eos_token_ids: list[int] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))


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

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            at = first.get("loc", ("body", "?"))[-1]
            reason = first.get("ctx", {}).get("error")
            return JSONResponse(error_body(f"the body is not valid JSON ({reason} at {at})"), 400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return JSONResponse(
            error_body(f"{where}: {message}" if where else message, where or None), 400
        )

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, err: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(err), err.param), 400)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, err: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(err), code="engine_dead"), 500)

    @app.get("/health")
    async def health() -> Any:
        if not async_engine.alive:
            return JSONResponse({"status": "engine stopped"}, 503)
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
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        prompts = [_prompt_ids(state, p) for p in body.prompts()]
        limit = body.max_tokens or 16
        configs = [_config(state, body, ids, limit) for ids in prompts]
        return await _serve(async_engine, request, body, prompts, configs, CompletionFormat(state))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        messages = [m.as_dict() for m in body.messages]
        try:
            text = state.chat_template.render(messages, body.add_generation_prompt)
        except ValueError as err:
            raise BadRequest(str(err), "messages") from err
        ids = _prompt_ids(state, text)
        room = state.engine.config.max_model_len - len(ids)
        config = _config(state, body, ids, body.token_limit or max(room, 1))
        return await _serve(async_engine, request, body, [ids], [config], ChatFormat(state))

    return app


# ------------------------------------------------------------------------ request checks
def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise BadRequest(
            f"the model {name!r} does not exist; this server serves {state.model_name!r}", "model"
        )


def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send token ids as the prompt", "prompt")
        return encode(state.engine.tokenizer, prompt)
    return list(prompt)


def _config(state: ServerState, body: Any, ids: list[int], max_tokens: int) -> GenerationConfig:
    try:
        config = body.generation_config(max_tokens, state.eos_token_ids)
        state.engine.check_request("", ids, config)
    except ValueError as err:
        message = str(err).removeprefix("GenerationConfig: ")
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
    streams = [
        async_engine.generate(f"{rid}-{i}", ids, config)
        for i, (ids, config) in enumerate(zip(prompts, configs))
    ]
    if body.stream:
        return StreamingResponse(
            _sse(fmt, rid, streams, n, prompts, body.include_usage),
            media_type="text/event-stream",
        )
    finals = await _until_done_or_disconnect(request, streams)
    return fmt.response(rid, finals, n, prompts)


async def _until_done_or_disconnect(
    request: Request, streams: list[AsyncIterator[RequestOutput]]
) -> list[RequestOutput]:
    """The final output of every stream; abort them all if the client goes away first."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watch = asyncio.ensure_future(disconnected())
    await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not work.done():
        work.cancel()  # closing the streams aborts their requests
        await asyncio.gather(work, return_exceptions=True)
        raise asyncio.CancelledError("client disconnected")
    return work.result()


async def _sse(fmt: CompletionFormat, rid: str, streams: list, n: int, prompts: list[list[int]],
               include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """Merge the prompts' streams into one event stream (choice index = prompt * n + seq)."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await merged.put((p, output))
        except Exception as err:  # reported in the stream: the status line is already sent
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
                yield _event(error_body(str(output)))
                continue
            for seq in output.outputs:
                completion_tokens += len(seq.new_token_ids)
                chunk = fmt.chunk(rid, p * n + seq.index, seq)
                if chunk is not None:
                    yield _event(chunk)
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
    """``text_completion`` objects."""

    state: ServerState
    prefix: str = "cmpl"

    def _base(self, rid: str) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.state.model_name}  # fmt: skip

    def response(self, rid: str, finals: list[RequestOutput], n: int, prompts) -> dict:
        choices, tokens = [], 0
        for p, final in enumerate(finals):
            for seq in sorted(final.outputs, key=lambda o: o.index):
                tokens += len(seq.token_ids)
                choices.append({"index": p * n + seq.index, "text": seq.text, "logprobs": None,
                                "finish_reason": seq.finish_reason})  # fmt: skip
        return {**self._base(rid), "choices": choices, "usage": usage(prompts, n, tokens)}

    def first_chunks(self, rid: str, choices: int) -> list[dict]:
        return []

    def chunk(self, rid: str, index: int, seq: Any) -> dict | None:
        if not seq.new_text and seq.finish_reason is None:
            return None
        choice = {"index": index, "text": seq.new_text, "logprobs": None,
                  "finish_reason": seq.finish_reason}  # fmt: skip
        return {**self._base(rid), "choices": [choice]}

    def usage_chunk(self, rid: str, counts: dict) -> dict:
        return {**self._base(rid), "choices": [], "usage": counts}


@dataclass
class ChatFormat(CompletionFormat):
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    prefix: str = "chatcmpl"

    def _base(self, rid: str, chunk: bool = True) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": rid, "object": kind, "created": int(time.time()),
                "model": self.state.model_name}  # fmt: skip

    def response(self, rid: str, finals: list[RequestOutput], n: int, prompts) -> dict:
        (final,) = finals
        choices, tokens = [], 0
        for seq in sorted(final.outputs, key=lambda o: o.index):
            tokens += len(seq.token_ids)
            choices.append({"index": seq.index, "logprobs": None,
                            "message": {"role": "assistant", "content": seq.text},
                            "finish_reason": seq.finish_reason})  # fmt: skip
        return {**self._base(rid, chunk=False), "choices": choices,
                "usage": usage(prompts, n, tokens)}  # fmt: skip

    def first_chunks(self, rid: str, choices: int) -> list[dict]:
        return [
            {**self._base(rid), "choices": [{"index": i, "logprobs": None, "finish_reason": None,
                                             "delta": {"role": "assistant", "content": ""}}]}
            for i in range(choices)
        ]  # fmt: skip

    def chunk(self, rid: str, index: int, seq: Any) -> dict | None:
        if not seq.new_text and seq.finish_reason is None:
            return None
        delta = {"content": seq.new_text} if seq.new_text else {}
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": seq.finish_reason}  # fmt: skip
        return {**self._base(rid), "choices": [choice]}
