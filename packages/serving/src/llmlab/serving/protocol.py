"""The OpenAI request bodies, checked field by field, and their translation to GenerationConfig.

Field names, defaults and meanings are OpenAI's (``max_tokens`` 16 for completions, none for
chat; ``temperature`` 1; ``temperature: 0`` means greedy). vLLM's extensions that map onto
``llmlab.decoding`` are accepted too (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``no_repeat_ngram_size``, ``ignore_eos``), and beam search (``num_beams``,
``length_penalty``, ``early_stopping``: the ``n`` best of ``num_beams`` beams, greedy).
Log-probabilities are OpenAI's: ``logprobs: N`` (0..20) and ``echo`` on completions
(``max_tokens: 0`` only with ``echo``), ``logprobs: true`` and ``top_logprobs: N`` on chat; they
become the request's ``RequestOptions``. Structured output is OpenAI's: ``response_format``
(``json_object``, ``json_schema``) on both endpoints, ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` on chat (``llmlab.serving.structured`` turns them into a grammar; the
server does). OpenAI options the engine cannot honour (penalties by frequency, logit bias...)
are refused with a 400 naming the field when they are set to anything but their default, and
unknown fields are refused: an option that would silently change nothing is an error, not a
no-op.

Types are strict (pydantic's strict mode: ``"max_tokens": true``, ``"stream": "yes"`` or
``"temperature": "0.5"`` are refused, not coerced; an integer is a float where a float is
wanted) and numbers must be finite (``1e400`` parses as infinity and is refused). Ranges are
checked here too, so that every value the engine admits is one it can serve.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from llmlab.decoding import GenerationConfig
from llmlab.serving.sequence import RequestOptions

# strict types, no unknown fields, no inf/NaN: every model of a request body
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_STOP_CHARS = 1024  # a longer stop string cannot be produced within any context served here
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range
MAX_LENGTH_PENALTY = 20.0  # |length_penalty|: length ** it stays finite for any context length
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's chat limit, vLLM's default)

# field -> its "off" value: anything else is refused as unsupported
UNSUPPORTED: dict[str, Any] = {
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "suffix": None,
}
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. A schema is
    enforced whatever ``strict`` says (as vLLM does)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class SamplingFields(BaseModel):
    """The sampling fields completions and chat share."""

    model_config = STRICT

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    no_repeat_ngram_size: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    # beam search (llmlab extension): the n best of num_beams beams, deterministic
    num_beams: int = Field(1, ge=1, le=64)
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as OpenAI's own (an end-user id for abuse logs)
    # unsupported unless left at their defaults (UNSUPPORTED)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # the grammar the server built for this request (llmlab.serving.structured), if any
    _grammar: str | None = PrivateAttr(None)
    # the LoRA adapter ``model`` names (vLLM's convention), None for the base model
    _adapter: str | None = PrivateAttr(None)

    @property
    def grammar_field(self) -> str:
        """The request field a grammar comes from: ``response_format``, else ``tools``."""
        fmt = self.response_format
        return "response_format" if fmt is not None and fmt.type != "text" else "tools"

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        for name, off in UNSUPPORTED.items():
            value = getattr(self, name, off)
            harmless = name == "best_of" and value == self.n  # plain sampling
            if value not in (off, None) and not harmless:
                raise ValueError(f"{name}={value!r} is not supported by llmlab.serving")
        if self.num_beams > 1 and self.temperature not in (None, 0.0):
            raise ValueError(
                f"num_beams={self.num_beams} is deterministic beam search: leave temperature "
                f"unset or 0, got {self.temperature}"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError(f"stop holds at most 4 strings, got {len(self.stop)}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if "" in stops:
            raise ValueError("stop strings must not be empty")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"stop strings hold at most {MAX_STOP_CHARS} characters")
        return self

    def generation_config(self, max_new_tokens: int, eos_token_ids: list[int]) -> GenerationConfig:
        temperature = 1.0 if self.temperature is None else self.temperature
        if self.num_beams > 1:
            temperature = 0.0
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            no_repeat_ngram_size=self.no_repeat_ngram_size or 0,
            num_return_sequences=self.n,
            eos_token_id=None if self.ignore_eos or not eos_token_ids else list(eos_token_ids),
            stop_strings=self.stop,
            seed=self.seed,
            num_beams=self.num_beams,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
        config.validate()
        return config

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt's log-probabilities)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompts_not_empty(self) -> CompletionRequest:
        if self.prompt in ("", []) or (isinstance(self.prompt, list) and "" in self.prompt):
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it is only allowed with echo=true")
        return self

    @property
    def token_limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def request_options(self) -> RequestOptions:
        """``logprobs: N``: each generated token's log-probability and the N most likely;
        with ``echo``, the prompt's tokens' too; ``max_tokens: 0``: the prompt alone."""
        return RequestOptions(
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            prompt_only=self.max_tokens == 0,
            grammar=self._grammar,
            adapter=self._adapter,
        )

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    # extra fields (e.g. "name") are passed to the template as given
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {**self.model_dump(exclude_none=True), "content": content or ""}
        calls = out.get("tool_calls")
        if isinstance(calls, list):  # chat templates read a call's arguments as a mapping
            out["tool_calls"] = [_arguments_as_mapping(c) for c in calls]
        return out


def _arguments_as_mapping(call: Any) -> Any:
    """An OpenAI tool call with its ``arguments`` JSON string parsed (what HF chat templates
    render with ``tojson``); anything else unchanged."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [t.function.name for t in self.tools or []]:
                raise ValueError(f"tool_choice names the function {name!r}, which tools lacks")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        fixed = self.response_format is not None and self.response_format.type != "text"
        if self.forced_tools and fixed:
            raise ValueError(
                f"response_format={self.response_format.type!r} and tool_choice="
                f"{self.tool_choice_name!r} each fix the output's form: send one of them"
            )
        return self

    @property
    def tool_choice_name(self) -> str:
        """``none``, ``auto``, ``required`` or ``function`` (a named one); ``none`` when there
        are no tools, ``auto`` when tools come with no choice (OpenAI's defaults)."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "function" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    @property
    def tools_active(self) -> bool:
        """Whether the model's text is parsed for tool calls."""
        return self.tool_choice_name != "none"

    @property
    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools a grammar makes the model call: all of them (``required``), the named
        one, or none (``auto``, ``none``)."""
        choice = self.tool_choice_name
        if choice == "required":
            return [t.model_dump(exclude_none=True) for t in self.tools or []]
        if choice == "function":
            name = self.tool_choice.function.name
            return [t.model_dump(exclude_none=True) for t in self.tools or []
                    if t.function.name == name]  # fmt: skip
        return []

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def request_options(self) -> RequestOptions:
        """``logprobs: true``: each generated token's log-probability, with the
        ``top_logprobs`` most likely tokens at its position."""
        return RequestOptions(
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            grammar=self._grammar,
            adapter=self._adapter,
        )


def error_body(
    message: str,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> dict:
    """OpenAI's error object (every error the server answers has this shape)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
