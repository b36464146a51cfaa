"""Unigram language-model tokenizer (SentencePiece-style).

Text is normalized (optional NFKC, extra spaces removed), spaces become ``▁`` and a ``▁`` is
prepended, so word boundaries are ordinary characters. Each piece ``x`` has a score
``log p(x)``; a text is segmented by Viterbi into the pieces maximising ``Σ log p(x_i)``.
Characters no piece covers become ``<unk>`` (score ``min score - 10``), and a run of unknown
characters is one ``<unk>``, as in sentencepiece.

Training (``unigram_train``) is EM over a large seed vocabulary with pruning by the loss in
likelihood each piece's removal would cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmlab.tokenizer import metaspace
from llmlab.tokenizer.base import TokenizerBase, unknown_id
from llmlab.tokenizer.hf_schema import added_token, read_added, require, skeleton
from llmlab.tokenizer.metaspace import NORMALIZATIONS, SPACE
from llmlab.tokenizer.pretokenize import iter_file_lines
from llmlab.tokenizer.unigram_train import train_unigram

UNK_PENALTY = 10.0


class UnigramTokenizer(TokenizerBase):
    model = "unigram"

    def __init__(
        self,
        pieces: Sequence[tuple[str, float]],
        unk_id: int = 0,
        control_ids: Sequence[int] = (),
        add_dummy_prefix: bool = True,
        remove_extra_whitespaces: bool = True,
        normalization: str = "nfkc",
    ):
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
            )
        self.pieces = [(str(p), float(s)) for p, s in pieces]
        if not 0 <= unk_id < len(self.pieces):
            raise ValueError(f"unk_id {unk_id} is outside the {len(self.pieces)} pieces")
        self.unk_id = unk_id
        self.control_ids = set(control_ids)
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces
        self.normalization = normalization
        skip = self.control_ids | {unk_id}
        self.scores = {p: (i, s) for i, (p, s) in enumerate(self.pieces) if i not in skip}
        self.max_len = max((len(p) for p in self.scores), default=1)
        self.prefixes = {p[:k] for p in self.scores for k in range(1, len(p) + 1)}
        normal = [s for i, (_, s) in enumerate(self.pieces) if i not in skip]
        self.unk_score = min(normal, default=0.0) - UNK_PENALTY
        self.special_tokens = {self.pieces[i][0]: i for i in sorted(self.control_ids)}
        self._cache: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- training
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        normalization: str = "nfkc",
        add_dummy_prefix: bool = True,
        remove_extra_whitespaces: bool = True,
        **kwargs: Any,
    ) -> UnigramTokenizer:
        """EM training (``unigram_train.train_unigram``; ``kwargs`` are its settings)."""
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
            )
        options = dict(
            normalization=normalization,
            add_dummy_prefix=add_dummy_prefix,
            remove_extra_whitespaces=remove_extra_whitespaces,
        )
        pieces, reserved = train_unigram(texts, vocab_size, **options, **kwargs)
        return cls(pieces, unk_id=0, control_ids=range(1, reserved), **options)

    @classmethod
    def train_from_files(
        cls, paths: Iterable[str | Path], vocab_size: int, **kw: Any
    ) -> UnigramTokenizer:
        """``train`` on the lines of UTF-8 files, line endings removed."""
        return cls.train((ln.rstrip("\r\n") for ln in iter_file_lines(paths)), vocab_size, **kw)

    # ----------------------------------------------------------------- encoding
    def normalize(self, text: str) -> str:
        return metaspace.normalize(
            text, self.normalization, self.remove_extra_whitespaces, self.add_dummy_prefix
        )

    def viterbi(self, text: str) -> list[int]:
        """Best segmentation of an already-normalized string, as piece ids."""
        n = len(text)
        best = [float("-inf")] * (n + 1)
        back: list[tuple[int, int]] = [(-1, -1)] * (n + 1)  # (start, piece id)
        best[0] = 0.0
        scores, prefixes, max_len = self.scores, self.prefixes, self.max_len
        for start in range(n):
            base = best[start]
            if base == float("-inf"):
                continue
            single = False
            for end in range(start + 1, min(n, start + max_len) + 1):
                sub = text[start:end]
                if sub not in prefixes:
                    break
                hit = scores.get(sub)
                if hit is None:
                    continue
                if end == start + 1:
                    single = True
                candidate = base + hit[1]
                if back[end][0] == -1 or candidate > best[end]:
                    best[end], back[end] = candidate, (start, hit[0])
            if not single:
                candidate = base + self.unk_score
                if back[start + 1][0] == -1 or candidate > best[start + 1]:
                    best[start + 1], back[start + 1] = candidate, (start, self.unk_id)
        ids: list[int] = []
        end = n
        while end > 0:
            start, pid = back[end]
            if pid == self.unk_id and ids and ids[-1] == self.unk_id:
                pass  # a run of unknown characters is a single <unk>
            else:
                ids.append(pid)
            end = start
        ids.reverse()
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        out: list[int] = []
        for line in text.split("\n"):  # sentencepiece encodes sentence by sentence
            cached = self._cache.get(line)
            if cached is None:
                cached = self.viterbi(self.normalize(line))
                if len(self._cache) < 100_000:
                    self._cache[line] = cached
            out.extend(cached)
        return out

    def decode_pieces(self, ids: Iterable[int]) -> list[bytes]:
        """Each id's text: ``▁`` as a space, ``<unk>`` as " ⁇ " and control pieces as nothing
        (sentencepiece's rules); the dummy-prefix space at the start is dropped."""
        parts = []
        for i in ids:
            if not 0 <= i < len(self.pieces):
                raise unknown_id(i, self.vocab_size)
            if i in self.control_ids:
                parts.append("")
            else:
                piece = " \u2047 " if i == self.unk_id else self.pieces[i][0]
                parts.append(piece.replace(SPACE, " "))
        if self.add_dummy_prefix:
            first = next((k for k, p in enumerate(parts) if p), None)
            if first is not None and parts[first].startswith(" "):
                parts[first] = parts[first][1:]
        return [p.encode("utf-8") for p in parts]

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def eos_token_id(self) -> int | None:
        return self.special_tokens.get("</s>")

    def token_to_id(self, token: str) -> int | None:
        if token == self.pieces[self.unk_id][0]:
            return self.unk_id
        hit = self.scores.get(token)
        return self.special_tokens.get(token) if hit is None else hit[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.pieces[token_id][0] if 0 <= token_id < len(self.pieces) else None

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        return {
            "unk_id": self.unk_id,
            "control_ids": sorted(self.control_ids),
            "add_dummy_prefix": self.add_dummy_prefix,
            "remove_extra_whitespaces": self.remove_extra_whitespaces,
            "normalization": self.normalization,
            "pieces": [[p, s] for p, s in self.pieces],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> UnigramTokenizer:
        kwargs = {
            k: data[k]
            for k in (
                "unk_id",
                "control_ids",
                "add_dummy_prefix",
                "remove_extra_whitespaces",
                "normalization",
            )
            if k in data
        }
        kwargs.update(options)
        return cls([tuple(p) for p in data["pieces"]], **kwargs)

    def to_hf(self) -> dict[str, Any]:
        out = skeleton()
        out["added_tokens"] = [
            added_token(self.pieces[i][0], i) for i in sorted(self.control_ids | {self.unk_id})
        ]
        steps: list[dict[str, Any]] = []
        if self.normalization == "nfkc":
            steps.append({"type": "NFKC"})
        if self.remove_extra_whitespaces:
            steps.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
            steps.append({"type": "Strip", "strip_left": True, "strip_right": True})
        out["normalizer"] = {"type": "Sequence", "normalizers": steps} if steps else None
        scheme = "always" if self.add_dummy_prefix else "never"
        meta = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": True}
        out["pre_tokenizer"] = meta
        out["decoder"] = meta
        out["model"] = {
            "type": "Unigram",
            "unk_id": self.unk_id,
            "vocab": [[p, s] for p, s in self.pieces],
            "byte_fallback": False,
        }
        return out

    @classmethod
    def from_hf(cls, data: dict[str, Any], path: Path, **options: Any) -> UnigramTokenizer:
        norm = data.get("normalizer")
        steps = [] if norm is None else norm.get("normalizers", [norm])
        normalization, remove_extra = "identity", False
        for step in steps:
            kind = step.get("type")
            if kind == "NFKC":
                normalization = "nfkc"
            elif kind in ("Replace", "Strip"):
                remove_extra = True
            else:
                raise ValueError(
                    f"normalizer {kind!r} is not supported for Unigram (NFKC, Replace, Strip)"
                )
        pre = require(data.get("pre_tokenizer"), "Metaspace", "pre-tokenizer", "Unigram")
        if pre.get("replacement", SPACE) != SPACE:
            raise ValueError(f"Metaspace replacement {pre['replacement']!r} is not {SPACE!r}")
        scheme = pre.get(
            "prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never"
        )
        model = data["model"]
        if model.get("byte_fallback"):
            raise ValueError("Unigram byte_fallback is not supported")
        unk_id = model.get("unk_id")
        if unk_id is None:
            raise ValueError("Unigram model without unk_id is not supported")
        controls = [i for i in read_added(data).values() if i != unk_id]
        kwargs: dict[str, Any] = dict(
            unk_id=int(unk_id),
            control_ids=controls,
            add_dummy_prefix=scheme != "never",
            remove_extra_whitespaces=remove_extra,
            normalization=normalization,
        )
        kwargs.update(options)
        return cls([(p, float(s)) for p, s in model["vocab"]], **kwargs)

    @classmethod
    def from_sentencepiece(cls, processor: Any, **options: Any) -> UnigramTokenizer:
        """Same pieces and scores as a loaded ``sentencepiece.SentencePieceProcessor``."""
        n = processor.get_piece_size()
        pieces = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(n)]
        controls = [i for i in range(n) if processor.is_control(i)]
        return cls(pieces, unk_id=processor.unk_id(), control_ids=controls, **options)

    def __repr__(self) -> str:
        return f"UnigramTokenizer(vocab_size={self.vocab_size})"
