"""SentencePiece BPE with byte fallback: the tokenizer of Llama 2, Mistral, Gemma and many more.

Spaces become ``▁`` and a ``▁`` is put in front (so word boundaries are ordinary characters), the
text is split into characters, and adjacent symbols are merged, the pair whose concatenation
has the best *score* first (leftmost among equals). A character no piece covers becomes its UTF-8
bytes as ``<0x41>``-style pieces (``byte_fallback``), else ``<unk>`` (a run of them one
``<unk>``).

Two sources, each encoded as its own library does:

- a SentencePiece ``.model`` (or a model llmlab trained): sentencepiece's rules —
  ``SentencePieceNormalizer`` (charsmap, dummy prefix, whitespace) and merges ranked by piece
  score (every split of a piece shares its rank);
- an HF ``tokenizer.json`` (``BPE`` with ``byte_fallback``, ``Metaspace`` or ``▁``-replacing
  normalizers): HF's rules — its normalizer / pre-tokenizer pipeline (``hf_components``) and its
  ranked merge list.

Speed: no piece contains ``x▁`` (``x`` not ``▁``) in these vocabularies, so no merge crosses the
start of a ``▁``-run that follows other text; llmlab cuts the text there and encodes (and
caches) each word on its own, which gives the same ids as merging the whole line. A vocabulary
where that does not hold is encoded line by line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import regex

from llmlab.tokenizer import hf_components, sp_model
from llmlab.tokenizer.base import TokenizerBase, unknown_id, write_atomic
from llmlab.tokenizer.char_bpe import CharBPEModel, Table, merges_table
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.gcpause import paused_gc
from llmlab.tokenizer.sp_bpe_train import WORDS, Piece, train_pieces
from llmlab.tokenizer.sp_hf import from_hf_fields, to_hf
from llmlab.tokenizer.sp_normalizer import SPACE, SentencePieceNormalizer, split_matches

_CROSSING = regex.compile(r"[^▁]▁")
UNK_SURFACE = " \u2047 "  # what sentencepiece decodes <unk> to
_SP_SYMBOLS = ("normal", "unknown", "byte")  # what sentencepiece's merging and lookups see


class SentencePieceBPETokenizer(TokenizerBase):
    """A SentencePiece BPE model: ``pieces`` in id order, each ``(text, score, kind)``."""

    model = "sentencepiece_bpe"
    save_formats = ("llmlab", "hf", "sentencepiece")

    def __init__(
        self,
        pieces: Sequence[Piece],
        byte_fallback: bool = True,
        normalizer: SentencePieceNormalizer | hf_components.Pipeline | dict[str, Any] | None = None,
        merges: Sequence[tuple[str, str]] | None = None,
        fuse_unk: bool = True,
        ignore_merges: bool = False,
        decoder: dict[str, Any] | None = None,
        special_tokens: Sequence[str] | None = None,
    ):
        self.pieces = [(str(p), float(s), str(k)) for p, s, k in pieces]
        kinds = {k for _, _, k in self.pieces}
        if kinds - {"normal", "unknown", "control", "user_defined", "byte"}:
            raise ValueError(f"piece kinds {sorted(kinds)} include unsupported ones (unused?)")
        self.vocab: dict[str, int] = {}
        for i, (piece, _, _) in enumerate(self.pieces):
            self.vocab.setdefault(piece, i)
        self.user_defined = tuple(p for p, _, k in self.pieces if k == "user_defined")
        self.hf_mode = isinstance(normalizer, hf_components.Pipeline)
        if normalizer is None or isinstance(normalizer, dict):
            normalizer = SentencePieceNormalizer.from_dict(normalizer or {}, self.user_defined)
        self.front = normalizer
        self.merges = None if merges is None else [tuple(m) for m in merges]
        self.byte_fallback = byte_fallback
        self.ignore_merges = ignore_merges
        self.decoder_spec = decoder
        unk = next((p for p, _, k in self.pieces if k == "unknown"), None)
        if self.merges is None:  # sentencepiece: any split of a piece, ranked by the piece's score
            lookup = {p: i for p, i in self.vocab.items() if self.pieces[i][2] in _SP_SYMBOLS}
            table = _score_table(self.pieces, lookup)
        else:  # HF: the file's merge list, ranked by position
            lookup = self.vocab
            table = merges_table(self.vocab, self.merges, None)
        self.bpe = CharBPEModel(lookup, table, unk, fuse_unk, byte_fallback)
        if special_tokens is None:
            special_tokens = [p for p, _, k in self.pieces if k == "control"]
        self.special_tokens = {p: self.vocab[p] for p in special_tokens}
        self.unk_id = None if unk is None else self.vocab[unk]
        self._user_split = (
            regex.compile(
                "|".join(regex.escape(s) for s in sorted(self.user_defined, key=len)[::-1])
            )
            if self.user_defined
            else None
        )
        self._splittable = SPACE in lookup and not any(_CROSSING.search(p) for p in self.vocab)

    # ----------------------------------------------------------------- training
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        byte_fallback: bool = True,
        character_coverage: float = 0.9995,
        add_dummy_prefix: bool = True,
        remove_extra_whitespaces: bool = False,
        control_tokens: Sequence[str] = ("<s>", "</s>"),
        user_defined_symbols: Sequence[str] = (),
        unk_token: str = "<unk>",
        min_frequency: int = 0,
        workers: int = 1,
        show_progress: bool | None = None,
    ) -> SentencePieceBPETokenizer:
        """A SentencePiece BPE model (``model_type=bpe``, ``identity`` normalization) learned
        from ``texts``, one sentence each (``sp_bpe_train``). The defaults are Llama 2's: byte
        fallback, dummy prefix, spaces kept as they are."""
        normalizer = SentencePieceNormalizer(
            add_dummy_prefix, remove_extra_whitespaces, user_defined=tuple(user_defined_symbols)
        )
        if show_progress is None:
            show_progress = sys.stderr.isatty()
        pieces = train_pieces(
            texts,
            vocab_size,
            normalizer,
            byte_fallback,
            character_coverage,
            control_tokens,
            unk_token,
            min_frequency,
            workers,
            show_progress,
        )
        return cls(pieces, byte_fallback, normalizer)

    # ----------------------------------------------------------------- encoding
    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode_segment(text, at_start=True)

    def _encode_segment(self, text: str, at_start: bool) -> list[int]:
        if self.hf_mode:  # HF: added tokens out of the raw text, then the pipeline
            out: list[int] = []
            for k, (part, is_symbol) in enumerate(self._split_user_defined(text)):
                if is_symbol:
                    out.append(self.vocab[part])
                    continue
                for word in self.front(part, at_start and k == 0):  # type: ignore[call-arg]
                    if self.ignore_merges and word in self.vocab:
                        out.append(self.vocab[word])
                    else:
                        out.extend(self._words(word))
            return out
        out = []  # sentencepiece: normalize, then user-defined symbols stay whole
        for part, is_symbol in self._split_user_defined(self.front(text)):  # type: ignore[call-arg]
            out.extend([self.vocab[part]] if is_symbol else self._words(part))
        return out

    def encode_ordinary_batch(
        self, texts: Sequence[str], *, num_threads: int = 8
    ) -> list[list[int]]:
        """``encode_ordinary`` of each text; with sentencepiece's rules and no user-defined
        symbols, all texts' words go through the model in one batch."""
        with paused_gc():  # a list per text (gcpause)
            if self.hf_mode or self._user_split is not None or not self._splittable:
                return [self.encode_ordinary(t) for t in texts]
            findall = WORDS.findall
            normalized = self.front.normalize_batch(texts)  # type: ignore[union-attr]
            return self.bpe.encode_word_lists([findall(t) for t in normalized])

    def _split_user_defined(self, text: str) -> list[tuple[str, bool]]:
        return split_matches(text, self._user_split)

    def _words(self, text: str) -> list[int]:
        if not self._splittable:
            return self.bpe.tokenize(text)
        return self.bpe.encode_words(WORDS.findall(text))

    # ----------------------------------------------------------------- decoding
    def decode_pieces(self, ids: Iterable[int]) -> list[bytes]:
        """Each id's bytes, sentencepiece's rules: control pieces are invisible, ``<unk>`` is
        " ⁇ ", byte pieces are their byte, ``▁`` is a space, and the first piece that writes
        anything loses its leading ``▁`` (the dummy prefix)."""
        out: list[bytes] = []
        written = False
        strip = self._strips_prefix()
        for i in ids:
            if not 0 <= i < len(self.pieces):
                raise unknown_id(i, self.vocab_size)
            piece, _, kind = self.pieces[i]
            if kind == "control":
                data = b""
            elif kind == "unknown":
                data = (piece if self.hf_mode else UNK_SURFACE).encode("utf-8")
            elif kind == "byte":
                data = bytes([int(piece[3:5], 16)])
            else:
                if strip and not written and piece.startswith(SPACE):
                    piece = piece[1:]
                data = piece.replace(SPACE, " ").encode("utf-8")
            written = written or bool(data)
            out.append(data)
        return out

    def _strips_prefix(self) -> bool:
        if not self.hf_mode:
            front: SentencePieceNormalizer = self.front  # type: ignore[assignment]
            return front.add_dummy_prefix or front.remove_extra_whitespaces
        steps = hf_components.flatten(self.decoder_spec)
        return any(
            (s.get("type") == "Strip" and s.get("start", s.get("left", 0)))
            or (s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never")
            for s in steps
        )

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """ids -> text; each byte of an invalid UTF-8 sequence becomes U+FFFD (sentencepiece)."""
        data = self.decode_bytes(ids)
        if errors != "replace":
            return data.decode("utf-8", errors=errors)
        out, pos = [], 0
        while pos < len(data):
            try:
                out.append(data[pos:].decode("utf-8"))
                break
            except UnicodeDecodeError as exc:
                out.append(data[pos : pos + exc.start].decode("utf-8"))
                out.append("\ufffd")
                pos += exc.start + 1
        return "".join(out)

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def eos_token_id(self) -> int | None:
        return self.special_tokens.get("</s>")

    @property
    def bos_token_id(self) -> int | None:
        return self.special_tokens.get("<s>")

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.pieces[token_id][0] if 0 <= token_id < len(self.pieces) else None

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "byte_fallback": self.byte_fallback,
            "fuse_unk": self.bpe.fuse_unk,
            "ignore_merges": self.ignore_merges,
            "pieces": [list(p) for p in self.pieces],
            "special_tokens": list(self.special_tokens),
        }
        if self.hf_mode:
            out["hf_normalizer"] = self.front.normalizer_spec  # type: ignore[union-attr]
            out["hf_pre_tokenizer"] = self.front.pre_tokenizer_spec  # type: ignore[union-attr]
            out["decoder"] = self.decoder_spec
            out["merges"] = [" ".join(m) for m in self.merges or []]
        else:
            out["normalizer"] = self.front.to_dict()  # type: ignore[union-attr]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> SentencePieceBPETokenizer:
        normalizer: Any = data.get("normalizer")
        merges = None
        if "hf_normalizer" in data or "hf_pre_tokenizer" in data:
            normalizer = hf_components.Pipeline(
                data.get("hf_normalizer"), data.get("hf_pre_tokenizer")
            )
            merges = [tuple(m.split(" ")) for m in data.get("merges", [])]
        kwargs = dict(
            byte_fallback=data.get("byte_fallback", True),
            normalizer=normalizer,
            merges=merges,
            fuse_unk=data.get("fuse_unk", True),
            ignore_merges=data.get("ignore_merges", False),
            decoder=data.get("decoder"),
            special_tokens=data.get("special_tokens"),
        )
        return cls([tuple(p) for p in data["pieces"]], **{**kwargs, **options})

    def to_hf(self) -> dict[str, Any]:
        return to_hf(self)

    @classmethod
    def from_hf(cls, data: dict[str, Any], path: Path, **options: Any) -> SentencePieceBPETokenizer:
        return cls(**{**from_hf_fields(data), **options})

    def _save_format(self, path: Path, format: str) -> None:  # "sentencepiece": a .model
        if self.hf_mode:
            raise ValueError(
                "this tokenizer came from a tokenizer.json: its HF pipeline has no exact "
                "SentencePiece NormalizerSpec; save it as 'hf' or 'llmlab'"
            )
        front: SentencePieceNormalizer = self.front  # type: ignore[assignment]
        spec = {
            **front.to_dict(),
            "precompiled_charsmap": front.charsmap.blob if front.charsmap else b"",
        }
        write_atomic(path, sp_model.write_model(self.pieces, self.byte_fallback, spec))

    @classmethod
    def from_sentencepiece_file(cls, path: str | Path, **options: Any) -> SentencePieceBPETokenizer:
        """A BPE SentencePiece ``.model`` (needs the ``sentencepiece`` package's protobuf)."""
        path = Path(path)
        try:
            fields = sp_model.read_model(path)
            if fields["model_type"] != "bpe":
                raise ValueError(
                    f"model_type {fields['model_type']!r} is not supported here (BPE only; "
                    "a Unigram model loads with UnigramTokenizer.from_sentencepiece)"
                )
            charsmap = fields["normalizer"]["precompiled_charsmap"]
            user_defined = tuple(p for p, _, k in fields["pieces"] if k == "user_defined")
            normalizer = SentencePieceNormalizer(
                **{**fields["normalizer"], "precompiled_charsmap": charsmap},
                user_defined=user_defined,
            )
            return cls(fields["pieces"], fields["byte_fallback"], normalizer, **options)
        except ValueError as exc:
            raise TokenizerFileError(path, str(exc)) from exc

    def __repr__(self) -> str:
        source = "tokenizer.json" if self.hf_mode else "sentencepiece"
        return f"SentencePieceBPETokenizer(vocab_size={self.vocab_size}, rules={source!r})"


def _score_table(pieces: list[Piece], lookup: dict[str, int]) -> Table:
    """sentencepiece's merge rule as a table: every split ``(l, r)`` of a normal piece ``p``
    whose halves are pieces merges to ``p`` with rank ``-score(p)`` (equal ranks: leftmost)."""
    table: Table = {}
    normal = {p: i for p, i in lookup.items() if pieces[i][2] == "normal"}
    for piece, i in normal.items():
        rank = -pieces[i][1]
        for k in range(1, len(piece)):
            left, right = normal.get(piece[:k]), normal.get(piece[k:])
            if left is not None and right is not None:
                table[(left, right)] = (rank, i)
    return table
