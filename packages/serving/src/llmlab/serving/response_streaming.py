"""Serving a prepared request: its prompts queued on the ``AsyncEngine``, then either awaited
whole (aborted if the client disconnects) or merged into one server-sent event stream that ends
in ``data: [DONE]`` (or an OpenAI error event if a request fails mid-stream)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmlab.decoding import GenerationConfig
from llmlab.serving.async_engine import AsyncEngine, RequestFailed
from llmlab.serving.engine import RequestOutput
from llmlab.serving.protocol import error_body
from llmlab.serving.response_formats import CompletionFormat, Final, usage

log = logging.getLogger("llmlab.serving")


# ------------------------------------------------------------------------ serving a request
async def serve(
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


async def _sse(
    fmt: CompletionFormat,
    rid: str,
    streams: list,
    n: int,
    prompts: list[list[int]],
    include_usage: bool,
) -> AsyncIterator[str]:
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
                yield _event(
                    error_body(f"request {rid} failed: {output}", None, code, "server_error")
                )
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
