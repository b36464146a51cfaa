"""``AsyncEngine``: the synchronous engine on a background thread, fed by asyncio handlers.

The HTTP handlers run on uvicorn's event loop; the engine's forward passes must not block it.
So one thread owns the ``LLMEngine`` and is the only one that touches it: handlers send it
commands (add a request, abort one) through a queue, and it sends each request's outputs back
to that request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. Between commands the
thread steps the engine while there is work and sleeps on an event when there is none.

Cancellation: when a handler stops listening (the client disconnected, or the handler was
cancelled), the request is aborted; the engine thread frees its blocks before its next step.

Failure: a request the engine failed (``RequestOutput.error``) raises :class:`RequestFailed` in
its handler alone. Should a step itself raise (a bug outside any one request), every request in
flight fails with that error, the engine's queues are emptied, and the thread serves on: no
request kills the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator
from typing import Any

from llmlab.decoding import GenerationConfig
from llmlab.serving.engine import LLMEngine, RequestOutput
from llmlab.serving.sequence import RequestOptions

log = logging.getLogger("llmlab.serving")


class EngineDeadError(RuntimeError):
    """The engine thread died; the server cannot serve anything any more."""


class RequestFailed(RuntimeError):
    """The engine ended this request with an error (``RequestOutput.error``); others go on."""

    def __init__(self, request_id: str, error: str) -> None:
        super().__init__(error)
        self.request_id = request_id


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llmlab-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        config: GenerationConfig,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them, the last one ``finished``.

        Validate first with ``engine.check_request`` (it raises the 400s); leaving the loop
        early aborts the request.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine thread is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        self._send(("add", request_id, prompt_ids, config, options))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if self.engine.has_unfinished:
                    self._step()
                else:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as err:  # not an Exception (e.g. SystemExit): stop, loudly
            self.error = err
            traceback.print_exc()
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine failed: {err!r}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # outside every request's own guard: fail them all, go on
            log.exception("an engine step failed; failing the %d requests in flight",
                          len(self.engine._tracked))  # fmt: skip
            outputs = self.engine.fail_all(err)
        for output in outputs:
            if output.error is not None:
                self._deliver(output.request_id, RequestFailed(output.request_id, output.error))
            else:
                self._deliver(output.request_id, output)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt_ids, config, options = command
                if request_id not in self._streams:
                    continue  # the client left before the engine saw the request
                try:
                    self.engine.add_request(request_id, prompt_ids, config, options)
                except ValueError as err:
                    self._deliver(request_id, err)
                except Exception as err:  # e.g. building its processors: this request only
                    log.exception("request %s could not be added", request_id)
                    self.engine.stats.error("engine")
                    self.engine.abort(request_id)
                    self._deliver(request_id, RequestFailed(request_id, f"engine: {err!r}"))
            else:
                try:
                    self.engine.abort(command[1])
                except Exception:
                    log.exception("aborting request %s failed", command[1])

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the loop is closed (shutting down): nobody is listening
                self._streams.pop(request_id, None)
