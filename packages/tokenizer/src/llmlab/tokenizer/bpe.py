"""Byte-level BPE: train, encode (reference or tiktoken fast path), decode.

Id layout of a trained tokenizer (the same as HF ``tokenizers``' ByteLevel BPE trainer):
special tokens first (in the order given), then the 256 bytes in GPT-2 alphabet order (see
``byte_level.hf_byte_order``), then one id per merge. A token's id is also its *rank*: merges
learned earlier have lower ids, which is exactly what tiktoken's rank-ordered encoder needs, so
the learned table can be handed to ``tiktoken.Encoding`` unchanged.
"""

from __future__ import annotations

import copy
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from llmlab.tokenizer import bpe_files
from llmlab.tokenizer.base import TokenizerBase, unknown_id, write_atomic
from llmlab.tokenizer.bpe_encode import ChunkCache, derive_merges
from llmlab.tokenizer.byte_level import bytes_to_token_string, hf_byte_order, token_string_to_bytes
from llmlab.tokenizer.errors import UnknownTokenError
from llmlab.tokenizer.merge_trainer import id_char, train_merges
from llmlab.tokenizer.patterns import compiled, resolve_pattern
from llmlab.tokenizer.pretokenize import count_chunks
from llmlab.tokenizer.special import SpecialSpec, resolve_special

__all__ = ["BPETokenizer", "derive_merges"]

Backend = Literal["auto", "tiktoken", "reference"]


def _tiktoken_available() -> bool:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return True


def _check_specials(special_tokens: Sequence[str]) -> list[str]:
    specials = list(special_tokens)
    if len(set(specials)) != len(specials):
        raise ValueError(f"special_tokens contains duplicates: {specials}")
    for s in specials:
        if not isinstance(s, str) or not s:
            raise ValueError(f"special tokens must be non-empty strings, got {s!r}")
    return specials


class BPETokenizer(TokenizerBase):
    """A byte-level BPE tokenizer with tiktoken's encoding rule and special-token semantics.

    ``ranks`` maps each mergeable token's bytes to its id (= rank); all 256 single bytes must be
    present so that any text can be encoded. ``merges`` (pairs of ids) is kept when known, for
    the HF export; it is derived from the ranks when absent.
    """

    model = "bpe"
    save_formats = ("llmlab", "hf", "tiktoken")

    def __init__(
        self,
        ranks: dict[bytes, int],
        pattern: str = "gpt4",
        special_tokens: dict[str, int] | None = None,
        merges: list[tuple[int, int]] | None = None,
        add_prefix_space: bool = False,
        backend: Backend = "auto",
        normalizer: str | None = None,
    ):
        self.pattern = resolve_pattern(pattern)
        self.ranks = dict(ranks)
        self.special_tokens = dict(special_tokens or {})
        missing = [b for b in range(256) if bytes([b]) not in self.ranks]
        if missing:
            raise ValueError(
                f"a byte-level BPE needs all 256 single bytes in its vocabulary; missing "
                f"{len(missing)} (e.g. {[bytes([b]) for b in missing[:5]]})"
            )
        self.decoder: dict[int, bytes] = {i: t for t, i in self.ranks.items()}
        if len(self.decoder) != len(self.ranks):
            raise ValueError("two mergeable tokens share one id")
        for s, i in self.special_tokens.items():
            if i in self.decoder:
                raise ValueError(f"special token {s!r} has id {i}, already used by a token")
        self.special_decoder = {i: s for s, i in self.special_tokens.items()}
        self._merges = list(merges) if merges is not None else None
        self.add_prefix_space = add_prefix_space
        if normalizer not in (None, *bpe_files.NORMALIZERS):
            raise ValueError(
                f"normalizer must be None or one of {bpe_files.NORMALIZERS}, got {normalizer!r}"
            )
        self.normalizer = normalizer
        if backend not in ("auto", "tiktoken", "reference"):
            raise ValueError(f"backend must be 'auto', 'tiktoken' or 'reference', got {backend!r}")
        if backend == "tiktoken" and not _tiktoken_available():
            raise ImportError(
                "backend='tiktoken' needs tiktoken: pip install llmlab-tokenizer[fast]"
            )
        self._backend_request = backend
        self._tiktoken: Any = None
        self._cache = ChunkCache()

    # ----------------------------------------------------------------- training
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        pattern: str = "gpt4",
        special_tokens: Sequence[str] = (),
        min_frequency: int = 0,
        workers: int = 1,
        show_progress: bool | None = None,
    ) -> BPETokenizer:
        """Learn a vocabulary of ``vocab_size`` ids (specials + 256 bytes + merges).

        Each item of ``texts`` is pre-tokenized on its own (no chunk spans two items). Training
        stops early when no pair occurs at least ``max(min_frequency, 1)`` times.
        """
        regex_str = resolve_pattern(pattern)
        specials = _check_specials(special_tokens)
        minimum = 256 + len(specials)
        if not isinstance(vocab_size, int) or vocab_size < minimum:
            raise ValueError(
                f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs at least "
                f"{minimum} ids (256 bytes + {len(specials)} special tokens)"
            )
        if show_progress is None:
            show_progress = sys.stderr.isatty()
        chunk_counts = count_chunks(texts, regex_str, workers=workers)

        tokens: list[bytes | str] = [*specials]
        byte_id: dict[int, int] = {}
        for b in hf_byte_order():
            byte_id[b] = len(tokens)
            tokens.append(bytes([b]))
        # each chunk's bytes, spelled as the trainer's one-character-per-id string (in C)
        table = str.maketrans({chr(b): id_char(i) for b, i in byte_id.items()})
        words = [c.encode("utf-8").decode("latin-1").translate(table) for c in chunk_counts]
        counts = list(chunk_counts.values())
        del chunk_counts
        merges = train_merges(
            words,
            counts,
            tokens,
            vocab_size,
            concat=lambda a, b: a + b,
            min_frequency=min_frequency,
            show_progress=show_progress,
        )
        n = len(specials)
        ranks = {t: i for i, t in enumerate(tokens[n:], start=n)}
        return cls(
            ranks,
            pattern=regex_str,
            special_tokens={s: i for i, s in enumerate(specials)},
            merges=merges,
        )

    # ----------------------------------------------------------------- encoding
    @property
    def backend(self) -> str:
        """``"tiktoken"`` when the fast path is in use, else ``"reference"``."""
        return "tiktoken" if self._fast() is not None else "reference"

    def with_backend(self, backend: Backend) -> BPETokenizer:
        """A copy sharing the tables, forced to ``backend`` (to compare the two encoders)."""
        other = copy.copy(self)
        if backend not in ("auto", "tiktoken", "reference"):
            raise ValueError(f"backend must be 'auto', 'tiktoken' or 'reference', got {backend!r}")
        other._backend_request = backend
        other._tiktoken = None
        other._cache = ChunkCache()
        if backend == "tiktoken" and other._fast() is None:
            raise ImportError(
                "backend='tiktoken' needs tiktoken: pip install llmlab-tokenizer[fast]"
            )
        return other

    def _fast(self) -> Any:
        if self._backend_request == "reference":
            return None
        if self._tiktoken is None:
            if not _tiktoken_available():
                return None
            import tiktoken

            try:
                self._tiktoken = tiktoken.Encoding(
                    f"llmlab-bpe-{id(self)}",
                    pat_str=self.pattern,
                    mergeable_ranks=self.ranks,
                    special_tokens=self.special_tokens,
                )
            except Exception:
                if self._backend_request == "tiktoken":
                    raise
                self._backend_request = "reference"  # e.g. a regex fancy-regex cannot compile
                return None
        return self._tiktoken

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode ignoring special tokens entirely (their text is encoded as plain text)."""
        text = self._prepare(text)
        fast = self._fast()
        if fast is not None:
            return fast.encode_ordinary(text)
        text = _fix_surrogates(text)
        return self._cache.encode_chunks(compiled(self.pattern).findall(text), self.ranks)

    def _prepare(self, text: str) -> str:
        """The normalizer and the prefix space, as HF applies them to each segment."""
        if self.normalizer is not None:
            text = unicodedata.normalize(self.normalizer, _fix_surrogates(text))
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        return text

    def _plain_fast(self) -> Any:
        """tiktoken's Encoding when it can take the raw text as is (no normalizer, no prefix)."""
        if self.normalizer is not None or self.add_prefix_space:
            return None
        return self._fast()

    def encode(
        self,
        text: str,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
    ) -> list[int]:
        """Text -> ids. Special-token text raises unless allowed (tiktoken's semantics)."""
        fast = self._plain_fast()
        if fast is None:
            return super().encode(text, allowed_special, disallowed_special)
        allowed, disallowed = resolve_special(
            self.special_tokens, allowed_special, disallowed_special
        )
        return fast.encode(text, allowed_special=allowed, disallowed_special=disallowed)

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        num_threads: int = 8,
        allowed_special: SpecialSpec = frozenset(),
        disallowed_special: SpecialSpec = "all",
    ) -> list[list[int]]:
        """``encode`` of each text; on the fast path in ``num_threads`` threads (tiktoken's)."""
        fast = self._plain_fast()
        if fast is None:
            return [self.encode(t, allowed_special, disallowed_special) for t in texts]
        allowed, disallowed = resolve_special(
            self.special_tokens, allowed_special, disallowed_special
        )
        return fast.encode_batch(
            list(texts),
            num_threads=num_threads,
            allowed_special=allowed,
            disallowed_special=disallowed,
        )

    def encode_ordinary_batch(
        self, texts: Sequence[str], *, num_threads: int = 8
    ) -> list[list[int]]:
        fast = self._plain_fast()
        if fast is None:
            return [self.encode_ordinary(t) for t in texts]
        return fast.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def encode_single_token(self, token: str | bytes) -> int:
        """The id of exactly one token given as text or bytes, special tokens included
        (tiktoken's ``encode_single_token``); ``ValueError`` if it is not one token."""
        found = self.token_to_id(token.encode("utf-8") if isinstance(token, str) else token)
        if found is None:
            raise UnknownTokenError(f"{token!r} is not a single token of this vocabulary")
        return found

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    # ----------------------------------------------------------------- decoding
    def decode_pieces(self, ids: Iterable[int]) -> list[bytes]:
        decoder, special = self.decoder, self.special_decoder
        out = []
        for i in ids:
            piece = decoder.get(i)
            if piece is None:
                name = special.get(i)
                if name is None:
                    raise unknown_id(i, self.vocab_size)
                piece = name.encode("utf-8")
            out.append(piece)
        return out

    def decode_batch(
        self, batch: Sequence[Sequence[int]], *, errors: str = "replace", num_threads: int = 8
    ) -> list[str]:
        """``decode`` of each id list; on the fast path in ``num_threads`` threads (tiktoken's)."""
        fast = self._fast()
        if fast is not None:
            try:
                return fast.decode_batch([list(ids) for ids in batch], errors=errors,
                                         num_threads=num_threads)  # fmt: skip
            except KeyError:
                pass  # an unknown id: decoding again below raises the error that names it
        return [self.decode(ids, errors=errors) for ids in batch]

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (tiktoken's name); ``ValueError`` naming an unknown id."""
        return self.decode_pieces([token_id])[0]

    id_to_bytes = decode_single_token_bytes

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        """One more than the largest id: the size an embedding table needs."""
        return max(max(self.decoder), max(self.special_decoder, default=-1)) + 1

    n_vocab = vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.special_tokens.get("<|endoftext|>")

    eot_token = eos_token_id

    @property
    def special_tokens_set(self) -> set[str]:
        return set(self.special_tokens)

    def token_to_id(self, token: str | bytes) -> int | None:
        """Id of raw token bytes (a special token's bytes included), of a special token, or of
        a GPT-2/HF-spelled token string ("Ġthe"); None if there is none."""
        if isinstance(token, bytes):
            found = self.ranks.get(token)
            if found is None:
                found = self.special_tokens.get(token.decode("utf-8", "replace"))
            return found
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self.ranks.get(token_string_to_bytes(token))
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        """The token as HF spells it (bytes through GPT-2's table, e.g. "Ġthe"), or None."""
        if token_id in self.special_decoder:
            return self.special_decoder[token_id]
        data = self.decoder.get(token_id)
        return None if data is None else bytes_to_token_string(data)

    @property
    def merges(self) -> list[tuple[int, int]]:
        """Merges as (left id, right id) in rank order; derived from the ranks when unknown."""
        if self._merges is None:
            self._merges = derive_merges(self.ranks)
        return self._merges

    # ----------------------------------------------------------------- identity
    def __getstate__(self) -> dict[str, Any]:
        # The tiktoken Encoding and the chunk cache are rebuilt on demand: pickles stay small
        # and identical for identical tokenizers (HF datasets hashes them for its cache).
        state = self.__dict__.copy()
        state["_tiktoken"] = None
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("normalizer", None)
        self._cache = ChunkCache()

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        ordered = sorted(self.ranks.items(), key=lambda kv: kv[1])
        out = {
            "pattern": self.pattern,
            "add_prefix_space": self.add_prefix_space,
            "special_tokens": self.special_tokens,
            "vocab": {bytes_to_token_string(t): i for t, i in ordered},
            "merges": [
                f"{bytes_to_token_string(self.decoder[a])} {bytes_to_token_string(self.decoder[b])}"
                for a, b in self.merges
            ],
        }
        if self.normalizer is not None:  # absent in files written before it existed
            out["normalizer"] = self.normalizer
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], **options: Any) -> BPETokenizer:
        ranks = {token_string_to_bytes(t): int(i) for t, i in data["vocab"].items()}
        merges = []
        for line in data.get("merges", []):
            left, right = line.split(" ")
            merges.append((ranks[token_string_to_bytes(left)], ranks[token_string_to_bytes(right)]))
        return cls(
            ranks,
            pattern=data["pattern"],
            special_tokens={s: int(i) for s, i in data.get("special_tokens", {}).items()},
            merges=merges or None,
            add_prefix_space=bool(data.get("add_prefix_space", False)),
            normalizer=data.get("normalizer"),
            **options,
        )

    def to_hf(self) -> dict[str, Any]:
        return bpe_files.to_hf(self)

    @classmethod
    def from_hf(cls, data: dict[str, Any], path: Path, **options: Any) -> BPETokenizer:
        return cls(**{**bpe_files.from_hf(data, path), **options})

    def _save_format(self, path: Path, format: str) -> None:  # "tiktoken": base64 ranks
        write_atomic(path, bpe_files.save_tiktoken(self.ranks))

    def __repr__(self) -> str:
        return (
            f"BPETokenizer(vocab_size={self.vocab_size}, specials={len(self.special_tokens)}, "
            f"backend={self.backend!r})"
        )


def _fix_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates cannot be UTF-8: replace them with U+FFFD, as tiktoken does.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
