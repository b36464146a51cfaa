"""OpenAI's error shapes: every error the server answers has OpenAI's error body, whatever its
status, and is counted by kind in ``/metrics`` (``llmlab_request_errors_total``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlab.serving.async_engine import EngineDeadError, RequestFailed
from llmlab.serving.protocol import error_body

if TYPE_CHECKING:
    from llmlab.serving.server_state import ServerState

log = logging.getLogger("llmlab.serving")

# HTTP status -> (the metric's error kind, OpenAI's error type) where nothing more precise says
KINDS = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    500: "internal",
    503: "engine_dead",
}


class APIError(Exception):
    """An error answered with OpenAI's error body, ``status`` and a metric ``kind``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
        self.kind = kind or KINDS.get(status, "invalid_request")


class BadRequest(APIError):
    """A 400 naming the field at fault."""


def error_response(
    state: ServerState,
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """OpenAI's error body with ``status``, counted as ``kind`` in the engine's stats."""
    state.engine.stats.error(kind)
    kind_of_error = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, param, code, kind_of_error), status)


def install_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Answer every exception a route raises (ours, FastAPI's, Starlette's, the engine's and
    any other) with OpenAI's error body, so that no client ever sees FastAPI's own shape."""

    def error(
        status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ) -> JSONResponse:
        return error_response(state, status, message, kind, param, code)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error(err.status, str(err), err.kind, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err.errors())
        return error(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {
            404: f"no route {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(err.status_code, str(err.detail))
        response = error(err.status_code, message, KINDS.get(err.status_code, "http"))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, err: RequestFailed) -> JSONResponse:
        log.error("request %s failed: %s", err.request_id, err)  # counted by the engine
        body = error_body(
            f"request {err.request_id} failed: {err}", None, "request_failed", "server_error"
        )
        return JSONResponse(body, 500)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, err: EngineDeadError) -> JSONResponse:
        return error(503, str(err), "engine_dead", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return error(500, f"internal error: {err!r}", "internal", code="internal_error")


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` validated as ``model``; pydantic's first error becomes a 400 naming its field."""
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
