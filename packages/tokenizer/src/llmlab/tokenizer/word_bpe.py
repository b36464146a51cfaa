"""End-of-word BPE (Sennrich et al., 2016): BPE over the characters of whole words, the last
character marked with ``</w>`` so that "est</w>" (a word ending) and "est" (inside a word) are
different tokens. The format of GPT-1, CLIP and XLM, and of HF's ``CharBPETokenizer``.

A text is normalized and split into words by an HF-style pipeline (``hf_components``; default:
no normalizer, HF's ``Whitespace`` pre-tokenizer ``\\w+|[^\\w\\s]+``), then each word goes
through HF's BPE model (``char_bpe``): characters, ``</w>`` on the last, unknown characters to
``<unk>``, merges by rank. Training is HF's ``BpeTrainer(end_of_word_suffix="</w>")`` step for
step (``char_bpe_train``). Decoding replaces ``</w>`` by a space (nothing after the last token),
as HF's ``BPEDecoder``.

Files: HF ``tokenizer.json`` both ways, and the original ``vocab.json`` + ``merges.txt`` pair
(``save(folder, format="vocab_merges")``; ``load`` reads either file or the folder).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from llmlab.tokenizer import hf_components
from llmlab.tokenizer.base import TokenizerBase, unknown_id, write_atomic
from llmlab.tokenizer.bpe_files import merge_lines
from llmlab.tokenizer.byte_level import unicode_to_bytes
from llmlab.tokenizer.char_bpe import CharBPEModel, merges_table
from llmlab.tokenizer.char_bpe_train import train_char_bpe
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.gcpause import paused_gc
from llmlab.tokenizer.hf_schema import added_tokens, model_field, read_added, skeleton
from llmlab.tokenizer.pretokenize import count_chunks

Spec = dict[str, Any]


class WordBPETokenizer(TokenizerBase):
    """Character BPE with an end-of-word suffix; ``vocab`` maps token strings to ids and
    ``merges`` lists ``(left, right)`` token strings in rank order."""

    model = "word_bpe"
    save_formats = ("llmlab", "hf", "vocab_merges")
    DEFAULT_SUFFIX = "</w>"

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        end_of_word_suffix: str | None = DEFAULT_SUFFIX,
        continuing_subword_prefix: str | None = None,
        unk_token: str | None = "<unk>",
        fuse_unk: bool = False,
        byte_fallback: bool = False,
        ignore_merges: bool = False,
        special_tokens: Sequence[str] | dict[str, int] = ("<unk>",),
        normalizer: str | Spec | None = None,
        pre_tokenizer: str | Spec | None = "whitespace",
        decoder: Spec | Literal["bpe"] | None = "bpe",
    ):
        self.vocab = dict(vocab)
        self.merges = [tuple(m) for m in merges]
        if unk_token is not None and unk_token not in self.vocab:
            unk_token = None  # HF: unknown characters are then dropped
        table = merges_table(self.vocab, self.merges, continuing_subword_prefix)
        self.bpe = CharBPEModel(
            self.vocab,
            table,
            unk_token,
            fuse_unk,
            byte_fallback,
            continuing_subword_prefix,
            end_of_word_suffix,
            ignore_merges,
        )
        if not isinstance(special_tokens, dict):
            special_tokens = {s: self.vocab[s] for s in special_tokens if s in self.vocab}
        self.special_tokens = dict(special_tokens)
        self.inverse = {i: t for t, i in self.vocab.items()}
        self.inverse.update({i: s for s, i in self.special_tokens.items()})
        self.pipeline = hf_components.Pipeline.named(normalizer, pre_tokenizer)
        if decoder == "bpe":  # HF's BPEDecoder for this suffix
            decoder = {"type": "BPEDecoder", "suffix": end_of_word_suffix or ""}
        self.decoder_spec: Spec | None = decoder  # type: ignore[assignment]
        self._byte_level = self.pipeline.has("ByteLevel")

    # ----------------------------------------------------------------- training
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = ("<unk>",),
        unk_token: str | None = "<unk>",
        end_of_word_suffix: str | None = DEFAULT_SUFFIX,
        continuing_subword_prefix: str | None = None,
        normalizer: str | Spec | None = None,
        pre_tokenizer: str | Spec | None = "whitespace",
        min_frequency: int = 0,
        limit_alphabet: int | None = None,
        initial_alphabet: Iterable[str] = (),
        initial_tokens: Sequence[str] | None = None,
        workers: int = 1,
        show_progress: bool | None = None,
    ) -> WordBPETokenizer:
        """HF's ``BpeTrainer`` with ``end_of_word_suffix`` on the words of ``texts`` (each item
        normalized and pre-tokenized on its own). ``initial_tokens`` reproduces an HF run's id
        layout (see ``char_bpe_train``)."""
        if show_progress is None:
            show_progress = sys.stderr.isatty()
        pipeline = hf_components.Pipeline.named(normalizer, pre_tokenizer)
        words = count_chunks(texts, pipeline.as_regex() or pipeline, workers=workers)
        tokens, merges = train_char_bpe(
            words,
            vocab_size,
            special_tokens,
            continuing_subword_prefix,
            end_of_word_suffix,
            limit_alphabet,
            initial_alphabet,
            initial_tokens,
            min_frequency,
            show_progress,
        )
        return cls(
            {t: i for i, t in enumerate(tokens)},
            [(tokens[a], tokens[b]) for a, b in merges],
            end_of_word_suffix,
            continuing_subword_prefix,
            unk_token,
            special_tokens=special_tokens,
            normalizer=pipeline.normalizer_spec,
            pre_tokenizer=pipeline.pre_tokenizer_spec,
        )

    # ----------------------------------------------------------------- encoding
    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode_segment(text, at_start=True)

    def _encode_segment(self, text: str, at_start: bool) -> list[int]:
        return self.bpe.encode_words(self.pipeline(text, at_start))

    def encode_ordinary_batch(
        self, texts: Sequence[str], *, num_threads: int = 8
    ) -> list[list[int]]:
        """``encode_ordinary`` of each text, all texts' words through the model in one batch."""
        pipeline = self.pipeline
        with paused_gc():  # a list of words per text (gcpause)
            return self.bpe.encode_word_lists([pipeline(t) for t in texts])

    # ----------------------------------------------------------------- decoding
    def decode_pieces(self, ids: Iterable[int]) -> list[bytes]:
        """Each token's text as the file's decoder writes it: ``BPEDecoder`` (the default) turns
        ``</w>`` into a space (nothing after the last token); ``ByteLevel`` maps characters
        back to bytes; a file without a decoder joins the tokens with spaces, as HF does."""
        ids = list(ids)
        steps = {c.get("type"): c for c in hf_components.flatten(self.decoder_spec)}
        suffix = steps["BPEDecoder"].get("suffix", "</w>") if "BPEDecoder" in steps else ""
        table = unicode_to_bytes() if "ByteLevel" in steps or self._byte_level else None
        joiner = " " if self.decoder_spec is None else ""
        specials = set(self.special_tokens.values())
        out = []
        for n, i in enumerate(ids):
            token = self.inverse.get(i)
            if token is None:
                raise unknown_id(i, self.vocab_size)
            if suffix:
                token = token.replace(suffix, "" if n == len(ids) - 1 else " ")
            if n and joiner:
                token = joiner + token
            if table is not None and i not in specials:
                out.append(b"".join(bytes([table[c]]) if c in table else c.encode() for c in token))
            else:
                out.append(token.encode("utf-8"))
        return out

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return max(self.inverse, default=-1) + 1

    def token_to_id(self, token: str) -> int | None:
        return self.special_tokens.get(token, self.vocab.get(token))

    def id_to_token(self, token_id: int) -> str | None:
        return self.inverse.get(token_id)

    # ----------------------------------------------------------------- files
    def _options(self) -> dict[str, Any]:
        return {
            "end_of_word_suffix": self.bpe.suffix or None,
            "continuing_subword_prefix": self.bpe.prefix or None,
            "unk_token": self.bpe.unk_token,
            "fuse_unk": self.bpe.fuse_unk,
            "byte_fallback": self.bpe.byte_fallback,
            "ignore_merges": self.bpe.ignore_merges,
            "special_tokens": self.special_tokens,
            "normalizer": self.pipeline.normalizer_spec,
            "pre_tokenizer": self.pipeline.pre_tokenizer_spec,
            "decoder": self.decoder_spec,
        }

    def to_dict(self) -> dict[str, Any]:
        vocab = dict(sorted(self.vocab.items(), key=lambda kv: kv[1]))
        return {**self._options(), "vocab": vocab, "merges": [" ".join(m) for m in self.merges]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> WordBPETokenizer:
        kwargs = {k: data[k] for k in cls._option_names() if k in data}
        merges = [tuple(m.split(" ")) for m in data["merges"]]
        return cls(data["vocab"], merges, **{**kwargs, **options})

    @staticmethod
    def _option_names() -> tuple[str, ...]:
        return (
            "end_of_word_suffix",
            "continuing_subword_prefix",
            "unk_token",
            "fuse_unk",
            "byte_fallback",
            "ignore_merges",
            "special_tokens",
            "normalizer",
            "pre_tokenizer",
            "decoder",
        )

    def to_hf(self) -> dict[str, Any]:
        out = skeleton()
        out["added_tokens"] = added_tokens(self.special_tokens)
        out["normalizer"] = self.pipeline.normalizer_spec
        out["pre_tokenizer"] = self.pipeline.pre_tokenizer_spec
        out["decoder"] = self.decoder_spec
        out["model"] = self.bpe.to_hf(self.merges)
        return out

    @classmethod
    def from_hf(cls, data: dict[str, Any], path: Path, **options: Any) -> WordBPETokenizer:
        model = data["model"]
        model_field(model, "dropout", (None, 0.0))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        kwargs: dict[str, Any] = {
            "end_of_word_suffix": model.get("end_of_word_suffix"),
            "continuing_subword_prefix": model.get("continuing_subword_prefix"),
            "unk_token": model.get("unk_token"),
            "fuse_unk": bool(model.get("fuse_unk", False)),
            "byte_fallback": bool(model.get("byte_fallback", False)),
            "ignore_merges": bool(model.get("ignore_merges", False)),
            "special_tokens": read_added(data),
            "normalizer": data.get("normalizer"),
            "pre_tokenizer": data.get("pre_tokenizer"),
            "decoder": data.get("decoder"),
        }
        return cls(model["vocab"], merges, **{**kwargs, **options})

    def _save_format(self, path: Path, format: str) -> None:  # "vocab_merges": a folder
        path.mkdir(parents=True, exist_ok=True)
        vocab = dict(sorted(self.vocab.items(), key=lambda kv: kv[1]))
        write_atomic(path / "vocab.json", json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
        lines = "".join(f"{a} {b}\n" for a, b in self.merges)
        write_atomic(path / "merges.txt", ("#version: 0.2\n" + lines).encode("utf-8"))

    @classmethod
    def from_vocab_merges(cls, vocab: Path, merges: Path, **options: Any) -> WordBPETokenizer:
        """The original pair: ``vocab.json`` (token -> id) and ``merges.txt`` ("left right" per
        line, an optional ``#version`` first line). The files hold no pipeline: ``options``
        choose it (defaults: no normalizer, HF's ``Whitespace`` pre-tokenizer)."""
        try:
            table = json.loads(vocab.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerFileError(vocab, f"damaged JSON: {exc}") from exc
        pairs = []
        for lineno, line in merge_lines(merges):
            parts = line.split(" ")
            if len(parts) != 2:
                raise TokenizerFileError(merges, f"line {lineno} is not a merge 'left right'")
            pairs.append((parts[0], parts[1]))
        specials = [t for t in table if t.startswith("<") and t.endswith(">") and len(t) > 2]
        specials = [t for t in specials if not t.endswith(cls.DEFAULT_SUFFIX)]
        options.setdefault("special_tokens", specials)
        try:
            return cls(table, pairs, **options)
        except ValueError as exc:
            raise TokenizerFileError(merges, str(exc)) from exc

    def __repr__(self) -> str:
        return f"WordBPETokenizer(vocab_size={self.vocab_size}, suffix={self.bpe.suffix!r})"
