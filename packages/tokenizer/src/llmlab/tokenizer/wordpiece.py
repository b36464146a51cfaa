"""WordPiece (BERT): greedy longest-match-first over a vocabulary with ``##`` continuations.

A word is split left to right, each time taking the longest vocabulary entry that matches
(``##``-prefixed after the first piece); if some position matches nothing, or the word is longer
than ``max_input_chars_per_word`` characters, the whole word becomes ``[UNK]``.

Training learns the vocabulary the way HF's WordPieceTrainer does: byte-pair merges over
characters where every non-initial character carries the ``##`` prefix (so a merged token is
``a + b.removeprefix("##")``), using llmlab's incremental merge trainer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmlab.tokenizer import bert_text
from llmlab.tokenizer.base import TokenizerBase, unknown_id
from llmlab.tokenizer.bpe_encode import concat_cached
from llmlab.tokenizer.char_bpe_train import train_char_bpe
from llmlab.tokenizer.hf_schema import added_tokens, read_added, require, skeleton
from llmlab.tokenizer.pretokenize import count_chunks, count_tokens, expand_tokens
from llmlab.tokenizer.special import SpecialSpec

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# HF's WordPiece decoder cleanup: re-attach punctuation and English contractions.
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" do not", " don't"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class BertWords:
    """Text -> the BERT-normalized, pre-tokenized words training counts (picklable, for the
    worker processes). Both steps are character-local and split on whitespace, so a batch of
    texts joined by newlines gives exactly their words, in one call."""

    def __init__(self, tok: WordPieceTokenizer):
        self.options = (tok.clean_text, tok.handle_chinese_chars, tok.strip_accents, tok.lowercase)

    line_agnostic = True  # a line break is whitespace to the normalizer and the pre-tokenizer

    def __call__(self, text: str) -> list[str]:
        return bert_text.pre_tokenize(bert_text.normalize(text, *self.options))

    def split_batch(self, texts: list[str]) -> list[str]:
        return self("\n".join(texts))

    def count_units(self, texts: list[str], into: Counter[str]) -> Counter[str]:
        """The whitespace-separated tokens of the normalized batch (``expand`` splits them): the
        BERT words never hold whitespace."""
        return count_tokens(bert_text.normalize("\n".join(texts), *self.options), into)

    @staticmethod
    def expand(units: Counter[str]) -> Counter[str]:
        return expand_tokens(units, bert_text.WORDS.findall)


class WordPieceTokenizer(TokenizerBase):
    model = "wordpiece"

    def __init__(
        self,
        vocab: dict[str, int] | Sequence[str],
        unk_token: str = "[UNK]",
        continuing_subword_prefix: str = "##",
        max_input_chars_per_word: int = 100,
        lowercase: bool = True,
        strip_accents: bool | None = None,
        clean_text: bool = True,
        handle_chinese_chars: bool = True,
        special_tokens: Sequence[str] | None = None,
    ):
        if not isinstance(vocab, dict):
            vocab = {t: i for i, t in enumerate(vocab)}
        self.vocab = dict(vocab)
        if unk_token not in self.vocab:
            raise ValueError(f"unk_token {unk_token!r} is not in the vocabulary")
        self.inverse = {i: t for t, i in self.vocab.items()}
        self.unk_token = unk_token
        self.prefix = continuing_subword_prefix
        self.max_input_chars_per_word = max_input_chars_per_word
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.clean_text, self.handle_chinese_chars = clean_text, handle_chinese_chars
        specials = special_tokens if special_tokens is not None else BERT_SPECIALS
        self.special_tokens = {s: self.vocab[s] for s in specials if s in self.vocab}
        self._cache: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- training
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = BERT_SPECIALS,
        min_frequency: int = 0,
        limit_alphabet: int | None = None,
        initial_alphabet: Iterable[str] = (),
        initial_tokens: Sequence[str] | None = None,
        workers: int = 1,
        show_progress: bool = False,
        **options: Any,
    ) -> WordPieceTokenizer:
        """HF's ``WordPieceTrainer``: BPE over characters, non-initial ones ``##``-prefixed
        (``char_bpe_train``; ``initial_tokens`` reproduces an HF run's id layout). ``options``
        are the tokenizer's (normalizer settings, ``unk_token``...)."""
        specials = list(special_tokens)
        unk = options.get("unk_token", "[UNK]")
        if unk not in specials:
            specials.insert(0, unk)
        probe = cls(specials, special_tokens=specials, **options)
        words = count_chunks(texts, BertWords(probe), workers=workers)
        tokens, _ = train_char_bpe(
            words,
            vocab_size,
            specials,
            continuing_subword_prefix=probe.prefix,
            limit_alphabet=limit_alphabet,
            initial_alphabet=initial_alphabet,
            initial_tokens=initial_tokens,
            min_frequency=min_frequency,
            show_progress=show_progress,
        )
        return cls(tokens, special_tokens=specials, **options)

    # ----------------------------------------------------------------- encoding
    def normalize(self, text: str) -> str:
        return bert_text.normalize(
            text, self.clean_text, self.handle_chinese_chars, self.strip_accents, self.lowercase
        )

    @staticmethod
    def pre_tokenize(text: str) -> list[str]:
        return bert_text.pre_tokenize(text)

    def words(self, text: str) -> list[str]:
        """The pre-tokenized words of normalized ``text``."""
        return bert_text.pre_tokenize(self.normalize(text))

    def _word(self, word: str) -> list[int]:
        """Greedy longest-match-first pieces of one word ([UNK] if some position has none)."""
        unk = [self.vocab[self.unk_token]]
        if len(word) > self.max_input_chars_per_word:
            return unk
        out, start, n = [], 0, len(word)
        while start < n:
            end = n
            found = None
            while start < end:
                piece = word[start:end]
                if start > 0:
                    piece = self.prefix + piece
                found = self.vocab.get(piece)
                if found is not None:
                    break
                end -= 1
            if found is None:
                out = unk
                break
            out.append(found)
            start = end
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        return concat_cached(self.words(text), self._cache, self._word, 100_000)

    def encode(
        self,
        text: str,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Text -> ids; ``add_special_tokens`` wraps them in [CLS] ... [SEP] like BERT."""
        out = super().encode(text, allowed_special, disallowed_special)
        if add_special_tokens:
            out = [self.vocab["[CLS]"], *out, self.vocab["[SEP]"]]
        return out

    def decode(
        self, ids: Iterable[int], skip_special_tokens: bool = True, cleanup: bool = True
    ) -> str:
        """Join pieces as HF's WordPiece decoder does (see ``decode_pieces``)."""
        return b"".join(self.decode_pieces(ids, skip_special_tokens, cleanup)).decode("utf-8")

    def decode_pieces(
        self, ids: Iterable[int], skip_special_tokens: bool = True, cleanup: bool = True
    ) -> list[bytes]:
        """Each id's text as HF's WordPiece decoder writes it: ``##`` pieces glue to the
        previous one, others get a space; ``cleanup`` re-attaches punctuation, applied token by
        token (so " ." becomes "." but a contraction split over tokens stays split, exactly like
        HF). Skipped special tokens contribute nothing."""
        specials = set(self.special_tokens.values())
        out: list[bytes] = []
        started = False
        for i in ids:
            if i not in self.inverse:
                raise unknown_id(i, self.vocab_size)
            if skip_special_tokens and i in specials:
                out.append(b"")
                continue
            tok = self.inverse[i]
            if started and tok.startswith(self.prefix):
                tok = tok[len(self.prefix) :]
            elif started:
                tok = " " + tok
            if cleanup:
                for old, new in _CLEANUP:
                    tok = tok.replace(old, new)
            out.append(tok.encode("utf-8"))
            started = True
        return out

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return max(self.inverse) + 1

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inverse.get(token_id)

    # ----------------------------------------------------------------- files
    def options(self) -> dict[str, Any]:
        return {
            "unk_token": self.unk_token,
            "continuing_subword_prefix": self.prefix,
            "max_input_chars_per_word": self.max_input_chars_per_word,
            "lowercase": self.lowercase,
            "strip_accents": self.strip_accents,
            "clean_text": self.clean_text,
            "handle_chinese_chars": self.handle_chinese_chars,
            "special_tokens": list(self.special_tokens),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.options(), "vocab": [self.inverse.get(i) for i in range(self.vocab_size)]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> WordPieceTokenizer:
        vocab = {t: i for i, t in enumerate(data["vocab"]) if t is not None}
        kwargs = {k: data[k] for k in cls.__init__.__code__.co_varnames[2:10] if k in data}
        kwargs.update(options)
        return cls(vocab, **kwargs)

    def to_hf(self) -> dict[str, Any]:
        out = skeleton()
        out["added_tokens"] = added_tokens(self.special_tokens)
        out["normalizer"] = {
            "type": "BertNormalizer",
            "clean_text": self.clean_text,
            "handle_chinese_chars": self.handle_chinese_chars,
            "strip_accents": self.strip_accents,
            "lowercase": self.lowercase,
        }
        out["pre_tokenizer"] = {"type": "BertPreTokenizer"}
        if "[CLS]" in self.vocab and "[SEP]" in self.vocab:
            out["post_processor"] = {
                "type": "BertProcessing",
                "sep": ["[SEP]", self.vocab["[SEP]"]],
                "cls": ["[CLS]", self.vocab["[CLS]"]],
            }
        out["decoder"] = {"type": "WordPiece", "prefix": self.prefix, "cleanup": True}
        out["model"] = {
            "type": "WordPiece",
            "unk_token": self.unk_token,
            "continuing_subword_prefix": self.prefix,
            "max_input_chars_per_word": self.max_input_chars_per_word,
            "vocab": dict(sorted(self.vocab.items(), key=lambda kv: kv[1])),
        }
        return out

    @classmethod
    def from_hf(cls, data: dict[str, Any], path: Path, **options: Any) -> WordPieceTokenizer:
        norm = data.get("normalizer")
        kwargs: dict[str, Any] = {}
        if norm is None:
            kwargs.update(
                lowercase=False, strip_accents=False, clean_text=False, handle_chinese_chars=False
            )
        elif norm.get("type") == "BertNormalizer":
            kwargs.update(
                lowercase=norm.get("lowercase", True),
                strip_accents=norm.get("strip_accents"),
                clean_text=norm.get("clean_text", True),
                handle_chinese_chars=norm.get("handle_chinese_chars", True),
            )
        else:
            raise ValueError(
                f"normalizer {norm.get('type')!r} is not supported for WordPiece (BertNormalizer)"
            )
        require(data.get("pre_tokenizer"), "BertPreTokenizer", "pre-tokenizer", "WordPiece")
        model = data["model"]
        kwargs.update(
            unk_token=model.get("unk_token", "[UNK]"),
            continuing_subword_prefix=model.get("continuing_subword_prefix", "##"),
            max_input_chars_per_word=int(model.get("max_input_chars_per_word", 100)),
            special_tokens=list(read_added(data)),
        )
        kwargs.update(options)
        return cls({t: int(i) for t, i in model["vocab"].items()}, **kwargs)

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab_size={self.vocab_size})"
