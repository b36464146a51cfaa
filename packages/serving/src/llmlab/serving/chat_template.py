"""Chat templates: a conversation rendered into one prompt string, the way HF ``transformers`` does.

A chat model's tokenizer ships a Jinja template (``chat_template`` in ``tokenizer_config.json``,
or ``chat_template.jinja``) that turns ``messages = [{"role": ..., "content": ...}, ...]`` into
the text the model was trained on, e.g. ``<|im_start|>user\\nHi<|im_end|>\\n`` per message and
``<|im_start|>assistant\\n`` when ``add_generation_prompt`` asks the model to answer. llmlab's
tokenizers carry no template, so this module renders one as ``apply_chat_template`` does: a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that does not escape HTML,
and ``bos_token`` / ``eos_token`` in scope (tested to render exactly as ``transformers`` does).

Models trained here have no chat format at all; for them :data:`PLAIN_TEMPLATE` renders
``role: content`` lines and ends with ``assistant:``; with ``tools`` it lists them first, and
renders an assistant's tool calls in the Hermes format (``<tool_call>{json}</tool_call>``, what
``llmlab.serving.structured`` parses). The server says which template it uses. ``tools`` reach
the template as ``apply_chat_template(tools=...)`` passes them (OpenAI's tool objects).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% if tools %}tools:{% for tool in tools %} {{ tool | tojson }}{% endfor %} (call one as "
    '<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>)\n{% endif %}'
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker of the assistant's
    tokens (for training masks, ``return_assistant_tokens_mask``); rendering a prompt, its body
    is rendered as it is, as ``apply_chat_template`` renders it without the mask."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, GenerationTag],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not parse: {err}") from err
        self.source = source
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, OpenAI's tool objects); a
        template's own ``raise_exception`` (e.g. "roles must alternate") becomes a
        ``ValueError`` with its message."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                **self.special,
            )  # fmt: skip
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from err
