"""Response assembly: the engine's outputs shaped into OpenAI's objects -- whole responses and
stream chunks, ``text_completion`` and ``chat.completion`` -- with their log-probabilities
(``llmlab.serving.logprobs``) and, for a chat request with tools, its parsed ``tool_calls``."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmlab.serving.engine import RequestOutput
from llmlab.serving.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from llmlab.serving.sequence import TokenLogprob
from llmlab.serving.structured import parse_tool_calls

if TYPE_CHECKING:
    from llmlab.serving.server_state import ServerState


@dataclass
class Final:
    """A request's last output, with the log-probabilities its outputs carried one step at a
    time: the prompt's, and every generated token's by sequence index."""

    output: RequestOutput
    prompt_logprobs: list[TokenLogprob | None] | None
    logprobs: dict[int, list[TokenLogprob]]


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
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.body.model if self.body is not None else self.state.model_name,
        }

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
                choices.append(
                    {
                        "index": p * n + seq.index,
                        "text": prompt_text + seq.text,
                        "logprobs": logprobs,
                        "finish_reason": seq.finish_reason,
                    }
                )
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
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": seq.finish_reason,
        }
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
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.body.model if self.body is not None else self.state.model_name,
        }

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
            choices.append(
                {
                    "index": seq.index,
                    "logprobs": logprobs,
                    "message": message,
                    "finish_reason": finish_reason,
                }
            )
        return {
            **self._base(rid, chunk=False),
            "choices": choices,
            "usage": usage(prompts, n, tokens),
        }

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
            delta["tool_calls"] = [
                {"index": k, **call} for k, call in enumerate(message["tool_calls"])
            ]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return {**self._base(rid), "choices": [choice]}

    def first_chunks(self, rid: str, choices: int) -> list[dict]:
        return [
            {
                **self._base(rid),
                "choices": [
                    {
                        "index": i,
                        "logprobs": None,
                        "finish_reason": None,
                        "delta": {"role": "assistant", "content": ""},
                    }
                ],
            }
            for i in range(choices)
        ]

    def chunk(self, rid: str, p: int, index: int, seq: Any, output: RequestOutput) -> dict | None:
        logprobs = self._logprobs(seq.new_logprobs) if seq.new_logprobs else None
        if self.tool_format is not None:  # the text is parsed when it is whole: sent then
            return self._tool_chunk(rid, index, seq, logprobs)
        if not seq.new_text and logprobs is None and seq.finish_reason is None:
            return None
        delta = {"content": seq.new_text} if seq.new_text else {}
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": seq.finish_reason,
        }
        return {**self._base(rid), "choices": [choice]}
