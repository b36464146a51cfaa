"""An llmlab tokenizer as the files ``transformers.AutoTokenizer.from_pretrained(folder)`` reads.

``tokenizer.json`` is HF ``tokenizers``' own format (each tokenizer's ``to_hf()``), which
``AutoTokenizer`` wraps in a ``PreTrainedTokenizerFast``; ``tokenizer_config.json`` names that
class and which special tokens play which role (``eos_token``, ``bos_token``, ...), recognised
by their conventional spellings. ``clean_up_tokenization_spaces`` is off: a byte-level
tokenizer decodes to exactly the original text, and HF's clean-up would remove the space
before punctuation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROLES = {
    "<|endoftext|>": "eos_token",
    "<|end_of_text|>": "eos_token",
    "</s>": "eos_token",
    "<|begin_of_text|>": "bos_token",
    "<s>": "bos_token",
    "<unk>": "unk_token",
    "[UNK]": "unk_token",
    "<pad>": "pad_token",
    "[PAD]": "pad_token",
    "<|pad|>": "pad_token",
    "[CLS]": "cls_token",
    "[SEP]": "sep_token",
    "[MASK]": "mask_token",
}


class HFTokenizerFiles:
    """``save_pretrained(folder)`` for an llmlab tokenizer (any family), the method
    ``llmlab.models.save_pretrained`` calls on the tokenizer it is given."""

    def __init__(self, tokenizer: Any, model_max_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_max_length = model_max_length

    def special_token_roles(self) -> dict[str, str]:
        """``{"eos_token": "<|endoftext|>", ...}`` for the special tokens with a known role."""
        roles: dict[str, str] = {}
        for token in self.tokenizer.special_tokens:
            role = ROLES.get(token)
            if role is not None and role not in roles:
                roles[role] = token
        return roles

    def _role_id(self, role: str) -> int | None:
        token = self.special_token_roles().get(role)
        return None if token is None else int(self.tokenizer.special_tokens[token])

    # The attribute names of HF tokenizers, so that ``llmlab.models.save_pretrained`` reads the
    # ids the same way from either and writes them into ``config.json`` and
    # ``generation_config.json`` (without them transformers falls back to its class defaults,
    # e.g. GPT-2's 50256, an id outside a small vocabulary).
    @property
    def bos_token_id(self) -> int | None:
        return self._role_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._role_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._role_id("pad_token")

    def save_pretrained(self, folder: str | Path) -> list[str]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
        self.tokenizer.save(files[0], format="hf")
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_token_roles(),
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        files[1].write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        return [str(f) for f in files]
