"""Structured output: token masks from a grammar, so that a request's text always parses.

A request with a grammar (``RequestOptions.grammar``: an llguidance grammar, from
:func:`json_schema_grammar`, :func:`json_object_grammar` or :func:`tool_call_grammar`) decodes
each of its sequences under an ``llguidance.LLMatcher``: before a token is chosen, the logits of
every token the grammar does not allow next are set to ``-inf``; the chosen token then advances
the matcher. When the grammar can take no more (a JSON object's closing brace), the sequence
finishes with ``"stop"``.

Why llguidance (not xgrammar): it installs as one wheel with no dependencies (xgrammar needs
``apache-tvm-ffi`` and declares torch), builds its tokenizer from a plain list of each id's
bytes (so llmlab's own tokenizers, byte-level or BPE, work without an HF tokenizer object), and
computes a mask lazily per step in tens of microseconds with no per-schema compilation (xgrammar
precompiles each grammar against the vocabulary: milliseconds to seconds per new schema, which
every request with a fresh schema would pay before its first token).

Off the critical path: the mask for a sequence's next token depends only on the tokens it has
already accepted, so the engine computes the step's masks (:meth:`Grammars.masks`) right after
it has called the forward and before it reads the logits: on an accelerator the forward's
kernels are queued by then and run while the CPU computes the masks. On a CPU there is nothing
to overlap with, and a worker thread beside the forward measured worse than none (process CPU
time per token at batch 1: +3.5 ms of forward slowed by the thread against a 0.2 ms mask).
Whitespace is bounded: every JSON grammar here is compiled
with ``whitespace_flexible: false`` (compact ``,`` and ``:`` separators, no spaces, no newlines),
so a schema whose strings, arrays and numbers are bounded closes within a bounded number of
tokens.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance  # not llguidance.torch: it torch.compiles at import (seconds, and inductor)
import torch

# compact JSON: no whitespace between tokens (llguidance's default allows any run of it, which
# a random or weak model may emit forever)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
TOOL_TAGS = ("<tool_call>", "</tool_call>")  # the Hermes / Qwen tool-call format


# ----------------------------------------------------------------------------- grammars
def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON documents that validate against ``schema``."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``json_object``)."""
    return json_schema_grammar({"type": "object"})


def tool_call_schema(tools: list[dict[str, Any]], arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of one of ``tools`` (OpenAI's tool objects): ``{"name":
    <its name>, arguments_key: <its parameters>}``."""
    calls = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })  # fmt: skip
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_grammar(tools: list[dict[str, Any]], fmt: str, many: bool) -> str:
    """The grammar of the template's tool-call format (``fmt``: ``"hermes"`` or
    ``"llama3_json"``) holding one call of one of ``tools`` (``many``: one or more)."""
    if fmt == "hermes":
        schema = {**tool_call_schema(tools), "x-guidance": JSON_OPTIONS}
        call = f'"{TOOL_TAGS[0]}\\n" body "\\n{TOOL_TAGS[1]}"'
        start = 'call ("\\n" call)*' if many else "call"
        lark = f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if fmt == "llama3_json":
        schema = {**tool_call_schema(tools, "parameters"), "x-guidance": JSON_OPTIONS}
        start = 'call ("; " call)*' if many else "call"
        lark = f"start: {start}\ncall: %json {json.dumps(schema)}\n"
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown tool-call format {fmt!r}")


# ----------------------------------------------------------------------------- vocabulary
class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads: each id's bytes, the eos ids, the special
    ids (never allowed by a grammar that does not name them) and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int], banned: set[int]):
        decode = getattr(tokenizer, "decode_bytes", None) or (
            lambda ids: tokenizer.decode(ids).encode()
        )
        specials = dict(getattr(tokenizer, "special_tokens", None) or {})
        special = {i for s, i in specials.items() if s not in TOOL_TAGS} | set(banned)
        tokens = []
        for i in range(vocab_size):
            try:
                data = decode([i])
            except Exception:
                data = b""
            if not data:
                special.add(i)
            tokens.append(data if i not in special else f"<|special_{i}|>".encode())
        if not eos:  # no end token: a virtual one past the model's ids, never chosen
            eos = [vocab_size]
            tokens.append(b"<|virtual_eos|>")
            special.add(vocab_size)
        self.tokens = tokens
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(special | set(eos))
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text))


class Grammars:
    """An engine's grammar machinery: llguidance tokenizers (one per set of eos ids, built on
    first use and cached), matchers, and the batch mask computation."""

    def __init__(self, tokenizer: Any, vocab_size: int, banned: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.banned = set(banned.tolist()) if banned is not None else set()
        self._tokenizers: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()  # the server checks requests in its own threads

    def lltokenizer(self, eos: list[int]) -> Any:
        key = tuple(sorted(eos))
        with self._lock:
            found = self._tokenizers.get(key)
            if found is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the engine to have a tokenizer")
                vocab = _Vocab(self.tokenizer, self.vocab_size, list(key), self.banned)
                found = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens),
                    eos_token=list(key) or vocab.eos_token_id,
                )  # fmt: skip
                self._tokenizers[key] = found
            return found

    def check(self, grammar: str, eos: list[int]) -> None:
        """Raise ``ValueError`` with llguidance's message if ``grammar`` is not valid (an
        unknown type, a malformed schema, an impossible constraint)."""
        message = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer(eos))
        if message and not message.startswith("WARNING"):
            raise ValueError(f"invalid grammar: {message}")

    def matcher(self, grammar: str, eos: list[int]) -> Any:
        matcher = llguidance.LLMatcher(self.lltokenizer(eos), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: list[Any]) -> torch.Tensor:
        """(matchers, vocab_size) booleans, True where a matcher's grammar refuses the token: one
        matcher after the other (GPT-2's vocabulary inside a JSON string, measured: ~13 us in
        llguidance, ~49 us per row in all, 373 us for 8; at serving batch sizes llguidance's own
        parallel executor costs more in hand-offs than it saves on a few cores). From
        llguidance's byte-per-token mask (0: refused), which costs about half of expanding its
        bitmask in torch, contiguous so that the step's ``masked_fill`` is fast too."""
        rows = [
            torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[
                : self.vocab_size
            ]
            for m in matchers
        ]
        return torch.stack(rows) == 0


# ----------------------------------------------------------------------------- tool calls
def tool_call_format(template_source: str | None) -> str | None:
    """The tool-call format a chat template uses: ``"hermes"`` (``<tool_call>{json}
    </tool_call>``: Hermes, Qwen 2.5/3, llmlab's plain template) or ``"llama3_json"`` (a bare
    ``{"name": ..., "parameters": ...}``: Llama 3.1+); None if it does not render tools."""
    source = template_source or ""
    if "tools" not in source:
        return None
    if TOOL_TAGS[0] in source:
        return "hermes"
    if "parameters" in source:  # Llama 3.1's template describes the calls it wants so
        return "llama3_json"
    return None


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, calls)`` of a model's text: each call ``{"name": ..., "arguments": <a JSON
    string>}`` in order; ``content`` the text outside the calls (None if blank). A call that
    does not parse leaves the whole text as content and no calls."""
    calls: list[dict[str, Any]] = []
    if fmt == "hermes":
        open_, close = TOOL_TAGS
        if open_ not in text:
            return text, []
        content, rest = text.split(open_, 1)
        for part in (open_ + rest).split(open_)[1:]:
            body, sep, tail = part.partition(close)
            call = _call(body, "arguments")
            if call is None or (not sep and tail):
                return text, []
            calls.append(call)
            content += tail.strip("\n") if tail.strip() else ""
    elif fmt == "llama3_json":
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        for body in stripped.split("; "):
            call = _call(body, "parameters") or _call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = ""
    else:
        return text, []
    return (content if content.strip() else None), calls


def _call(body: str, key: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, {})
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
