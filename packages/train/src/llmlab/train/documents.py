"""Documents in, token ids out: what ``llmlab.train.prepare`` reads and how it tokenizes.

* :func:`input_files` expands the ``--input`` globs (sorted, in the order given) and refuses
  a glob that matches nothing or a file type HF ``datasets`` has no reader for here.
* :func:`load_documents` reads them with HF ``datasets`` (``text``: one document per file by
  default; ``json`` / ``parquet``: one per row, from a text column) into one Arrow table of
  documents, in input order.
* :func:`prepare_tokenizer` is ``bytes`` (the byte tokenizer with an end-of-document id, 256) or
  any tokenizer file ``llmlab.tokenizer.load`` reads, with its end-of-document special token.
* :func:`tokenized_batches` tokenizes the documents in ``num_proc`` worker processes, batch by
  batch *in order*, appends the end-of-document id, and marks each document for the train or
  validation split by a hash of its text -- so duplicates never straddle the split, and the
  split does not move when other documents are added.

No torch here: workers start by importing this module and should start in well under a second.
"""

from __future__ import annotations

import glob
import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

READERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
TEXT_UNITS = ("document", "paragraph", "line")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def input_files(patterns: Sequence[str]) -> list[Path]:
    """The files the globs name, each glob's matches sorted, duplicates dropped."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise ValueError(f"--input {pattern!r} matches no file")
        for m in matches:
            path = Path(m).resolve()
            if reader_of(path) is None:
                raise ValueError(
                    f"--input {pattern!r}: {path.name} is not a file type HF datasets reads here; "
                    f"valid extensions: {sorted(READERS)} (optionally .gz/.bz2/.xz/.zst)"
                )
            if path not in files:
                files.append(path)
    return files


def reader_of(path: Path) -> str | None:
    """The HF ``datasets`` builder for a file (``text``, ``json``, ``parquet``) or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    return READERS.get(suffixes[-1]) if suffixes else None


def load_documents(
    files: Sequence[Path] | None,
    cache_dir: Path | None,
    text_field: str = "text",
    text_unit: str = "document",
    dataset: str | None = None,
    dataset_split: str = "train",
) -> Any:
    """One HF ``Dataset`` with a ``text`` column: every document of ``files`` in order (or of
    the HF dataset ``dataset``, a hub name or a local folder), cached under ``cache_dir``."""
    import datasets

    if text_unit not in TEXT_UNITS:
        raise ValueError(f"--text-unit {text_unit!r} is not one of {list(TEXT_UNITS)}")
    datasets.disable_progress_bars()
    parts = []  # (dataset, its text column)
    if dataset is not None:
        cache = None if cache_dir is None else str(cache_dir)  # None: HF's default cache
        loaded = datasets.load_dataset(dataset, split=dataset_split, cache_dir=cache)
        parts.append((loaded, text_field))
    for reader, group in _runs_by_reader(files or []):
        kwargs: dict[str, Any] = {}
        if reader == "text":  # text files have one column, "text"
            kwargs = {"sample_by": text_unit, "keep_linebreaks": True}
        loaded = datasets.load_dataset(
            reader,
            data_files=[str(f) for f in group],
            split="train",
            cache_dir=str(cache_dir),
            **kwargs,
        )
        parts.append((loaded, "text" if reader == "text" else text_field))
    columns = []
    for part, field in parts:
        if field not in part.column_names:
            raise ValueError(
                f"the documents have no column {field!r}; columns: {part.column_names}; "
                "name the text column with --text-field"
            )
        part = part.select_columns([field])
        columns.append(part.rename_column(field, "text") if field != "text" else part)
    return datasets.concatenate_datasets(columns) if len(columns) > 1 else columns[0]


def _runs_by_reader(files: Sequence[Path]) -> Iterator[tuple[str, list[Path]]]:
    """Consecutive files with the same reader, so each ``load_dataset`` keeps their order."""
    run: list[Path] = []
    for f in files:
        if run and reader_of(f) != reader_of(run[0]):
            yield reader_of(run[0]) or "", run
            run = []
        run.append(f)
    if run:
        yield reader_of(run[0]) or "", run


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


def in_validation(text: bytes, val_fraction: float) -> bool:
    """Whether a document (its UTF-8 bytes) is held out: the first 8 bytes of its sha1 as a
    number in [0, 1), below ``val_fraction``."""
    digest = hashlib.sha1(text).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


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
