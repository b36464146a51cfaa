"""What every llmlab tokenizer shares: tiktoken's special-token handling, the batch and offset
APIs, saving, and a fingerprint.

A model (BPE, end-of-word BPE, SentencePiece BPE, WordPiece, Unigram) defines
``encode_ordinary`` (text with no special tokens -> ids), ``decode_pieces`` (ids -> the bytes each
token contributes to the decoded text), ``special_tokens``, and its serialisation: ``to_dict`` /
``from_dict`` (llmlab's readable JSON) and ``to_hf`` / ``from_hf`` (HF ``tokenizer.json``), plus
any format of its own (``_save_format``). Each subclass registers itself under its ``model`` name,
so ``formats.load`` finds the class of a saved file without this module importing any model:
that is what lets ``tok.save(path)`` be a method.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from llmlab.tokenizer.errors import UnknownTokenError
from llmlab.tokenizer.gcpause import paused_gc
from llmlab.tokenizer.pretokenize import FileLines
from llmlab.tokenizer.special import SpecialSpec, check_disallowed, resolve_special, split_special

FORMAT_TAG = "llmlab-tokenizer"
FORMAT_VERSION = 1


def unknown_id(token_id: Any, vocab_size: int) -> UnknownTokenError:
    """The error for an id outside the vocabulary, naming it and the valid range."""
    return UnknownTokenError(
        f"token id {token_id!r} is not in this vocabulary (valid ids: 0..{vocab_size - 1})"
    )


class TokenizerBase:
    """Base of every llmlab tokenizer; see the module docstring for what a model defines."""

    model: ClassVar[str]
    save_formats: ClassVar[tuple[str, ...]] = ("llmlab", "hf")
    registry: ClassVar[dict[str, type[TokenizerBase]]] = {}
    special_tokens: dict[str, int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "model" in cls.__dict__:
            TokenizerBase.registry[cls.model] = cls

    # ----------------------------------------------------------------- to define
    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, special-token text encoded as ordinary text."""
        raise NotImplementedError

    def decode_pieces(self, ids: Iterable[int]) -> list[bytes]:
        """The bytes each id contributes to the decoded text, in order."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> TokenizerBase:
        raise NotImplementedError

    def to_hf(self) -> dict[str, Any]:
        """HF ``tokenizer.json`` content."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    # ----------------------------------------------------------------- training
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, **kwargs: Any) -> TokenizerBase:
        raise NotImplementedError

    @classmethod
    def train_from_files(
        cls, paths: Iterable[str | Path], vocab_size: int, **kwargs: Any
    ) -> TokenizerBase:
        """``train`` on UTF-8 files read line by line, line endings kept (each line is one text,
        as HF's and sentencepiece's file trainers read them)."""
        return cls.train(FileLines(paths), vocab_size, **kwargs)

    # ----------------------------------------------------------------- encoding
    def _encode_segment(self, text: str, at_start: bool) -> list[int]:
        """Ids of text between special tokens; ``at_start``: it begins the input (pipelines
        whose pre-tokenizer treats the start of the input specially override this)."""
        return self.encode_ordinary(text)

    def encode(
        self,
        text: str,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
    ) -> list[int]:
        """Text -> ids. Special-token text raises unless allowed (tiktoken's semantics)."""
        allowed, disallowed = resolve_special(
            self.special_tokens, allowed_special, disallowed_special
        )
        check_disallowed(text, disallowed)
        out: list[int] = []
        start = 0
        for segment, is_special in split_special(text, allowed):
            if is_special:
                out.append(self.special_tokens[segment])
            else:
                out.extend(self._encode_segment(segment, at_start=start == 0))
            start += len(segment)
        return out

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        num_threads: int = 8,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
    ) -> list[list[int]]:
        """``encode`` of each text. ``num_threads`` is used where encoding releases the GIL
        (the tiktoken fast path); pure-Python encoders run the texts one after the other."""
        with paused_gc():  # one new list per text (gcpause)
            return [self.encode(t, allowed_special, disallowed_special) for t in texts]

    def encode_ordinary_batch(
        self, texts: Sequence[str], *, num_threads: int = 8
    ) -> list[list[int]]:
        """``encode_ordinary`` of each text (see ``encode_batch`` for ``num_threads``)."""
        with paused_gc():  # one new list per text (gcpause)
            return [self.encode_ordinary(t) for t in texts]

    # ----------------------------------------------------------------- decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.decode_pieces(ids))

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """ids -> text; bytes that are not valid UTF-8 become U+FFFD (as tiktoken)."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def decode_batch(
        self, batch: Sequence[Sequence[int]], *, errors: str = "replace", num_threads: int = 8
    ) -> list[str]:
        """``decode`` of each id list (``num_threads`` as for ``encode_batch``)."""
        return [self.decode(ids, errors=errors) for ids in batch]

    def decode_tokens_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """Each token's bytes, as tiktoken's ``decode_tokens_bytes``."""
        return self.decode_pieces(ids)

    def decode_with_offsets(self, ids: Sequence[int]) -> tuple[str, list[int]]:
        """(text, the character offset in ``text`` where each token starts), tiktoken's rule:
        a token that starts inside a multi-byte character is given that character's offset."""
        pieces = self.decode_pieces(ids)
        offsets = []
        length = 0
        for piece in pieces:
            starts_mid_char = bool(piece) and 0x80 <= piece[0] < 0xC0
            offsets.append(max(0, length - starts_mid_char))
            length += sum(1 for c in piece if not 0x80 <= c < 0xC0)
        return b"".join(pieces).decode("utf-8", errors="strict"), offsets

    # ----------------------------------------------------------------- files
    def save(self, path: str | Path, format: str = "llmlab") -> Path:
        """Write the tokenizer to ``path`` as ``format`` (``save_formats``: "llmlab" readable
        JSON, "hf" ``tokenizer.json``, and the model's own formats); returns the path.
        ``llmlab.tokenizer.load`` reads every one of them back."""
        if format not in self.save_formats:
            raise ValueError(
                f"format {format!r} is not available for a {self.model} tokenizer; valid "
                f"formats: {', '.join(self.save_formats)}"
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if format == "llmlab":
            payload = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "model": self.model}
            payload.update(self.to_dict())
            text = json.dumps(payload, ensure_ascii=False, indent=1)
            write_atomic(path, text.encode("utf-8"))
        elif format == "hf":
            write_atomic(path, json.dumps(self.to_hf(), ensure_ascii=False).encode("utf-8"))
        else:
            self._save_format(path, format)
        return path

    def _save_format(self, path: Path, format: str) -> None:
        raise NotImplementedError(format)

    # ----------------------------------------------------------------- identity
    @property
    def fingerprint(self) -> str:
        """A stable hash of everything that decides the ids (for cache keys)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            payload = json.dumps({"model": self.model, **self.to_dict()}, sort_keys=True)
            cached = hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]
            self.__dict__["_fingerprint"] = cached
        return cached


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file and rename, so a crash never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
