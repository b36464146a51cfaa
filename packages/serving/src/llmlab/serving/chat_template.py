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
``role: content`` lines and ends with ``assistant:``. The server says which template it uses.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``; a template's own ``raise_exception`` (e.g.
        "roles must alternate") becomes a ``ValueError`` with its message."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from err
