"""A real server for the tests: uvicorn on 127.0.0.1, on a port the OS picks, in a thread of the
test process (so a test can look inside the engine afterwards: every block free, every
reference count zero)."""

from __future__ import annotations

import threading
import time

import uvicorn

from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate
from llmlab.serving.server import ServerState, create_app
from llmlab.tokenizer import ByteTokenizer
from tests.serving.models import byte_gpt

MODEL_NAME = "tiny-bytes"


def byte_state(**engine: int | bool) -> ServerState:
    config = EngineConfig(**{"block_size": 8, "max_num_seqs": 32, "max_num_batched_tokens": 128,
                             "num_blocks": 96, **engine})  # fmt: skip
    return ServerState(LLMEngine(byte_gpt(), ByteTokenizer(), config), MODEL_NAME,
                       ChatTemplate(PLAIN_TEMPLATE))  # fmt: skip


class LiveServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine holds no request (aborts are processed between steps)."""
        engine = self.state.engine
        deadline = time.monotonic() + timeout
        while engine.has_unfinished or engine.scheduler.has_work:
            if time.monotonic() > deadline:
                raise AssertionError("the engine still holds requests")
            time.sleep(0.02)
