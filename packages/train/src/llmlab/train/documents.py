"""Documents in, token ids out: what ``llmlab.train.prepare`` reads and how it tokenizes.

* :func:`input_files` expands the ``--input`` globs and folders (sorted, in the order given) and
  refuses a glob that matches nothing or a file type HF ``datasets`` has no reader for here.
* :func:`check_inputs` refuses, before any work, what no record of a file can fix: an empty
  file, a binary (non-UTF-8) text file, a Parquet file that is not one or lacks a text column.
* :func:`load_documents` reads them with HF ``datasets`` (``text``: one document per file by
  default, or per paragraph / line; ``json`` / ``parquet``: one per record, from a text field)
  into one Arrow table of documents, in input order. A bad record (a line that is not JSON, a
  missing, null or non-string text field) is skipped and counted in :class:`BadRecords`, which
  warns with its file and line -- or, ``strict``, refused with that file and line.
* :func:`prepare_tokenizer` is ``bytes`` (the byte tokenizer with an end-of-document id, 256) or
  any tokenizer file ``llmlab.tokenizer.load`` reads, with its end-of-document special token.
* :func:`tokenized_batches` tokenizes the documents in ``num_proc`` worker processes, batch by
  batch *in order*, appends the end-of-document id, and marks each document for the train or
  validation split by a hash of its text -- so duplicates never straddle the split, and the
  split does not move when other documents are added.

Finding and checking the files lives in :mod:`llmlab.train.document_inputs`, reading them into
documents in :mod:`llmlab.train.document_loading`; their names are importable from here too.
No torch here: workers start by importing this module and should start in well under a second.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmlab.train.document_inputs import (
    COMPRESSIONS,
    NL,
    READERS,
    InputError,
    check_inputs,
    input_files,
    reader_of,
)
from llmlab.train.document_loading import (
    MAX_WARNINGS,
    TEXT_UNITS,
    BadRecords,
    load_documents,
)

__all__ = [
    "COMPRESSIONS",
    "EOS_CANDIDATES",
    "MAX_WARNINGS",
    "NL",
    "READERS",
    "TEXT_UNITS",
    "BadRecords",
    "InputError",
    "PrepareTokenizer",
    "TokenizedBatch",
    "check_inputs",
    "hash_fraction",
    "in_validation",
    "input_files",
    "load_documents",
    "prepare_tokenizer",
    "reader_of",
    "tokenize_texts",
    "tokenized_batches",
]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


# ---------------------------------------------------------------------------- tokenizers
@dataclass
class PrepareTokenizer:
    """The tokenizer a dataset is prepared with, and how the manifest records it."""

    tokenizer: Any
    eos_token_id: int
    entry: dict[str, Any]  # manifest["tokenizer"]

    @property
    def fingerprint(self) -> str:
        return self.entry["fingerprint"]


def prepare_tokenizer(spec: str, eos: str | None = None) -> PrepareTokenizer:
    """``bytes`` or a tokenizer file; ``eos`` names the end-of-document special token (default:
    the file's only special token, or the first of ``EOS_CANDIDATES`` it has)."""
    if spec == "bytes":
        from llmlab.tokenizer import ByteTokenizer

        if eos is not None:
            raise ValueError(
                "--eos applies to tokenizer files; bytes always ends documents with 256"
            )
        tok = ByteTokenizer(eos=True)
        entry = {"kind": "bytes", "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size}
        return PrepareTokenizer(tok, int(tok.eos_token_id), {**entry, "eos_token_id": 256})
    from llmlab.tokenizer import load

    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec!r}: no such file; valid: 'bytes' or a tokenizer file")
    tok = load(path)
    specials: dict[str, int] = dict(getattr(tok, "special_tokens", {}) or {})
    if eos is None:
        found = [s for s in EOS_CANDIDATES if s in specials]
        eos = next(iter(specials)) if len(specials) == 1 else (found[0] if found else None)
    if eos is None or eos not in specials:
        raise ValueError(
            f"--tokenizer {spec}: {'no' if eos is None else repr(eos) + ' is not a'} special "
            f"token to end documents with; its special tokens: {sorted(specials)} "
            "(name one with --eos)"
        )
    entry = {
        "kind": "file",
        "source": str(path.resolve()),
        "fingerprint": tok.fingerprint,
        "vocab_size": int(tok.vocab_size),
        "eos_token": eos,
        "eos_token_id": int(specials[eos]),
    }
    return PrepareTokenizer(tok, int(specials[eos]), entry)


# --------------------------------------------------------------------------- tokenizing
@dataclass
class TokenizedBatch:
    """A batch of documents as one flat id array (each document ending with the EOS id)."""

    ids: np.ndarray
    lengths: np.ndarray  # tokens per document
    validation: np.ndarray  # bool per document
    text_bytes: int

    def split(self, validation: bool) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths) of the documents of one split, in order."""
        keep = self.validation == validation
        return self.ids[np.repeat(keep, self.lengths)], self.lengths[keep]


def hash_fraction(text: bytes) -> float:
    """A document's (its UTF-8 bytes') place in [0, 1): the first 8 bytes of its sha1."""
    return int.from_bytes(hashlib.sha1(text).digest()[:8], "big") / 2.0**64


def in_validation(text: bytes, val_fraction: float) -> bool:
    """Whether a document is held out: its :func:`hash_fraction` is below ``val_fraction``."""
    return hash_fraction(text) < val_fraction


def tokenize_texts(
    texts: Sequence[str], tok: PrepareTokenizer, dtype: np.dtype, val_fraction: float
) -> TokenizedBatch:
    encode = getattr(tok.tokenizer, "encode_ordinary", tok.tokenizer.encode)
    pieces, lengths, held_out, size = [], [], [], 0
    eos = np.array([tok.eos_token_id], dtype=dtype)
    for text in texts:
        raw = text.encode("utf-8")
        size += len(raw)
        if tok.entry["kind"] == "bytes":  # the ids are the bytes: no Python list in between
            ids = np.frombuffer(raw, dtype=np.uint8).astype(dtype)
        else:  # special-token text in a document is text, never a control token
            ids = np.asarray(encode(text), dtype=dtype)
            if (ids == tok.eos_token_id).any():  # the loader finds documents by this id
                raise ValueError(
                    f"the tokenizer encodes a document's text with the end-of-document id "
                    f"{tok.eos_token_id} ({tok.entry['eos_token']!r}) inside it; choose another "
                    "--eos (a special token its ordinary encoding never produces)"
                )
        pieces += [ids, eos]
        lengths.append(len(ids) + 1)
        held_out.append(in_validation(raw, val_fraction))
    return TokenizedBatch(
        np.concatenate(pieces) if pieces else np.empty(0, dtype),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(held_out, dtype=bool),
        size,
    )


_WORKER: dict[str, Any] = {}


def _init_worker(tok: PrepareTokenizer, dtype: str, val_fraction: float) -> None:
    _WORKER.update(tok=tok, dtype=np.dtype(dtype), val=val_fraction)


def _tokenize(texts: list[str]) -> TokenizedBatch:
    return tokenize_texts(texts, _WORKER["tok"], _WORKER["dtype"], _WORKER["val"])


def tokenized_batches(
    documents: Any,
    tok: PrepareTokenizer,
    dtype: np.dtype,
    val_fraction: float,
    num_proc: int = 1,
    batch_documents: int = 256,
) -> Iterator[TokenizedBatch]:
    """Tokenized batches of ``documents`` in order. With ``num_proc`` > 1, this process reads
    the texts (Arrow, memory-mapped) and worker processes tokenize them, at most two batches per
    worker in flight (memory stays bounded), results taken in submission order. Batches hold at
    most ``batch_documents``, fewer when that would leave a worker idle (a few long documents)."""
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"--num-proc must be a positive integer, got {num_proc!r}")
    n = len(documents)
    if num_proc > 1:  # at least 8 batches per worker, so the last one does not finish alone
        batch_documents = max(1, min(batch_documents, n // (8 * num_proc)))
    texts = (documents[i : i + batch_documents]["text"] for i in range(0, n, batch_documents))
    if num_proc == 1:
        _init_worker(tok, dtype.str, val_fraction)
        yield from map(_tokenize, texts)
        return
    # spawn, not fork: the parent may hold threads (Arrow, tokenizers) that fork would copy
    # mid-lock; workers import only this module (numpy, no torch, no datasets) and the tokenizer.
    context = mp.get_context("spawn")
    init = (tok, dtype.str, val_fraction)
    with ProcessPoolExecutor(num_proc, context, initializer=_init_worker, initargs=init) as pool:
        pending: deque = deque()
        for batch in texts:
            pending.append(pool.submit(_tokenize, batch))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
