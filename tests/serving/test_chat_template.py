"""Chat templates render exactly as HF ``transformers``' ``apply_chat_template`` renders them.

The oracle is a ``PreTrainedTokenizerFast`` built offline around a tiny ``tokenizers`` model
with the same template and special tokens; templates cover ChatML (Qwen's shape), a Llama-2
style one that checks role alternation with ``raise_exception`` and uses ``bos_token`` /
``eos_token``, one using ``tojson``, ``loop.last`` and ``{% break %}``, and the chat example's,
whose ``{% generation %}`` blocks mark the assistant's tokens.
"""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + "
    "' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
TOJSON = (
    "{% for m in messages %}{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}\n>>>{% endif %}"
)
# the chat example's template (llmlab.train's examples/chat): transformers' {% generation %}
# marks the assistant's tokens for training masks; a prompt renders its body as it is
GENERATION = (json.loads((files("llmlab.train") / "examples" / "chat" / "tokenizer_config.json")
                         .read_text())["chat_template"])  # fmt: skip
MESSAGES = [
    {"role": "user", "content": "Hello <b>there</b> — é 🙂"},
    {"role": "assistant", "content": " Hi! "},
    {"role": "user", "content": "How are you?"},
]


def hf_tokenizer(template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=template)  # fmt: skip


@pytest.mark.parametrize("template", [CHATML, LLAMA2, TOJSON, PLAIN_TEMPLATE, GENERATION],
                         ids=["chatml", "llama2", "tojson", "plain", "generation"])  # fmt: skip
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers_does(template, generation_prompt):
    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>")
    want = hf_tokenizer(template).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours.render(MESSAGES, generation_prompt) == want


def test_a_template_refusal_and_a_syntax_error_become_value_errors():
    with pytest.raises(ValueError, match="roles must alternate"):
        ChatTemplate(LLAMA2).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
