"""The OpenAI-compatible HTTP layer: FastAPI routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream: true``, ending in ``data: [DONE]``; ``stream_options.include_usage`` adds a
last chunk with the token counts), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text). A LoRA adapter the engine serves is a model of its own: ``model`` names it
(vLLM's convention) and ``/v1/models`` lists it after the base. Every handler checks its
request completely -- body size, strict types, model name, prompt length against the context,
sampling values -- before it queues anything; the body is parsed, tokenized and checked in a
worker thread, never on the event loop. Every
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

Its parts: ``openai_errors`` (error bodies and handlers), ``request_preparation`` (parsing,
rendering, grammars, ``GenerationConfig``), ``response_streaming`` (queueing, awaiting,
server-sent events), ``response_formats`` (OpenAI's response and chunk objects) and
``server_state``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from llmlab.serving.async_engine import AsyncEngine
from llmlab.serving.openai_errors import (
    APIError,
    BadRequest,
    error_response,
    install_error_handlers,
)
from llmlab.serving.request_preparation import (
    off_the_loop,
    prepare_chat,
    prepare_completion,
    read_body,
)
from llmlab.serving.response_formats import ChatFormat, CompletionFormat
from llmlab.serving.response_streaming import serve
from llmlab.serving.server_state import DEFAULT_MAX_BODY_BYTES, ServerState
from llmlab.serving.structured import tool_call_format

__all__ = ["DEFAULT_MAX_BODY_BYTES", "APIError", "BadRequest", "ServerState", "create_app"]


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

    install_error_handlers(app, state)

    @app.get("/health")
    async def health() -> Any:
        if not async_engine.alive:
            message = "the engine thread is not running"
            return error_response(state, 503, message, "engine_dead", code="engine_dead")
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
        # each LoRA adapter is a model of its own over the base (vLLM's cards)
        loras = [{**card, "id": name, "parent": state.model_name, "root": name}
                 for name in state.engine.adapters.names]  # fmt: skip
        return {"object": "list", "data": [card, *loras]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.engine.stats.prometheus(), media_type="text/plain; version=0.0.4"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        raw = await read_body(request, state.max_body_bytes)
        body, prompts, configs = await off_the_loop(prepare_completion, state, raw)
        fmt = CompletionFormat(state, body=body)
        return await serve(async_engine, request, body, prompts, configs, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        raw = await read_body(request, state.max_body_bytes)
        body, prompts, configs = await off_the_loop(prepare_chat, state, raw)
        tools = tool_call_format(state.chat_template.source) if body.tools_active else None
        fmt = ChatFormat(state, body=body, tool_format=tools)
        return await serve(async_engine, request, body, prompts, configs, fmt)

    return app
