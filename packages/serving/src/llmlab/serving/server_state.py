"""What every route of the server shares: the engine, the model's name and chat template, and
the limits a request is checked against."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmlab.serving.chat_template import ChatTemplate
from llmlab.serving.engine import LLMEngine
from llmlab.serving.logprobs import TokenText

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # --max-body-bytes


@dataclass
class ServerState:
    """The served model and its settings, shared by the routes (``app.state.serving``)."""

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
