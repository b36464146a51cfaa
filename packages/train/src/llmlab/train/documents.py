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

No torch here: workers start by importing this module and should start in well under a second.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import hashlib
import io
import json
import logging
import lzma
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

log = logging.getLogger("llmlab.train.prepare")

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
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # .zst: zstandard's
NL = b"\n"
MAX_WARNINGS = 20  # bad records named one by one; the rest are counted in the summary


class InputError(ValueError):
    """An input file or record that cannot be prepared; the message names the file (and line)."""


def input_files(patterns: Sequence[str]) -> list[Path]:
    """The files the globs name, each glob's matches sorted, duplicates dropped. A folder
    stands for every file under it that HF ``datasets`` reads (sorted, hidden files skipped;
    other files are named in a warning), so ``--input corpus/`` takes a folder of documents."""
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if os.path.isdir(expanded):
            matches = _folder_files(pattern, Path(expanded))
        else:
            matches = sorted(glob.glob(expanded, recursive=True))
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


def _folder_files(pattern: str, folder: Path) -> list[str]:
    found, others = [], []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if not path.is_file() or any(p.startswith(".") for p in parts):
            continue
        (found if reader_of(path) else others).append(str(path))
    if not found:
        raise ValueError(
            f"--input {pattern!r}: the folder holds no file HF datasets reads here; valid "
            f"extensions: {sorted(READERS)} (optionally .gz/.bz2/.xz/.zst)"
        )
    if others:
        shown = ", ".join(Path(o).name for o in others[:5]) + (", ..." if len(others) > 5 else "")
        log.warning("warning: --input %r: skipped %d file(s) of other types: %s",
                    pattern, len(others), shown)  # fmt: skip
    return found


def reader_of(path: Path) -> str | None:
    """The HF ``datasets`` builder for a file (``text``, ``json``, ``parquet``) or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    return READERS.get(suffixes[-1]) if suffixes else None


# ------------------------------------------------------------------------ checking inputs
def check_inputs(files: Sequence[Path], text_field: str = "text") -> None:
    """Refuse, naming the file, what skipping records cannot fix: an empty file, a text file
    that is not UTF-8 text (a binary file), a Parquet file that is not one or whose text
    column is missing or not text. Reads every text file once: run it only when building."""
    for path in files:
        if path.stat().st_size == 0:
            raise InputError(f"{path} is empty (0 bytes): remove it from --input")
        reader = reader_of(path)
        if reader == "text":
            _check_text(path)
        elif reader == "parquet":
            _check_parquet(path, text_field)


def _open_binary(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed by its last suffix (.gz, .bz2, .xz, .zst)."""
    suffix = path.suffix.lower()
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError as err:
            raise InputError(
                f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
            ) from err
        return zstandard.open(path, "rb")
    opener = COMPRESSIONS.get(suffix)
    return opener(path, "rb") if opener else open(path, "rb")


def _check_text(path: Path, chunk: int = 1 << 20) -> None:
    """UTF-8 throughout and no NUL byte (which text never holds and binary files do)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1  # bytes and line of the start of ``block``
    with _open_binary(path) as f:
        while block := f.read(chunk):
            pending = decoder.getstate()[0]  # a character's first bytes, from the last block
            nul = block.find(b"\x00")
            try:
                decoder.decode(block if nul < 0 else block[:nul])
            except UnicodeDecodeError as err:
                at = err.start - len(pending)  # into ``block`` (negative: into ``pending``)
                byte, line = (pending + block)[err.start], lines + block[: max(at, 0)].count(NL)
                raise InputError(
                    f"{path}: not UTF-8 text (byte 0x{byte:02x} at offset {offset + at}, "
                    f"line {line}): a binary "
                    "file? only UTF-8 text can be prepared; remove it from --input or convert it"
                ) from None
            if nul >= 0:
                line = lines + block[:nul].count(NL)
                raise InputError(
                    f"{path}: a NUL byte at offset {offset + nul} (line {line}): a binary file, "
                    "not text; remove it from --input"
                )
            offset, lines = offset + len(block), lines + block.count(NL)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InputError(
                f"{path}: not UTF-8 text (it ends inside a character, offset {offset}, line "
                f"{lines}): only UTF-8 text can be prepared; remove it from --input or convert it"
            ) from None
    if offset == 0:
        raise InputError(f"{path} is empty (no text once decompressed): remove it from --input")


def _is_text_type(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(
        pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_string_view(arrow_type)
    )


def _check_parquet(path: Path, text_field: str) -> None:
    if path.suffix.lower() != ".parquet":
        return  # compressed: HF datasets reads (or refuses) it
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(-4, os.SEEK_END)
        tail = f.read(4)
    if path.stat().st_size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise InputError(f"{path} is not a Parquet file (no PAR1 marker at its start and end)")
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow's errors differ by damage
        raise InputError(f"{path} is a damaged Parquet file ({err})") from None
    texts = [f.name for f in schema if _is_text_type(f.type)]
    if text_field not in schema.names:
        raise InputError(
            f"{path} has no column {text_field!r}; its text columns: {texts}; name the text "
            "column with --text-field"
        )
    kind = schema.field(text_field).type
    if not _is_text_type(kind):
        raise InputError(
            f"{path}: column {text_field!r} holds {kind}, not text; its text columns: {texts}; "
            "name the text column with --text-field"
        )


@dataclass
class BadRecords:
    """Records skipped while loading: each named in a warning (the first ``MAX_WARNINGS``),
    all counted by kind and file for the summary -- or, ``strict``, the first one refused."""

    strict: bool = False
    kinds: dict[str, int] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    records: int = 0  # every record read, good and bad

    @property
    def skipped(self) -> int:
        return sum(self.kinds.values())

    def bad(self, source: str, where: str, kind: str, detail: str) -> None:
        """One bad record at ``source`` ``where`` (``line 3``, ``row 7``): warn and count it,
        or raise :class:`InputError` under ``strict``."""
        if self.strict:
            raise InputError(
                f"{source} {where}: {detail}; fix or remove the record (--strict: without it, "
                "bad records are skipped and counted)"
            )
        if self.skipped < MAX_WARNINGS:
            log.warning("warning: %s %s: %s; skipped", source, where, detail)
        elif self.skipped == MAX_WARNINGS:
            log.warning("warning: more bad records: counted in the summary, not listed")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.files[source] = self.files.get(source, 0) + 1

    def summary(self) -> str | None:
        """One line: how many records were skipped, why and where; None when none were."""
        if not self.skipped:
            return None
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.kinds.items())
        files = ", ".join(f"{source} ({n})" for source, n in self.files.items())
        return (
            f"skipped {self.skipped} bad record(s) of {self.records} ({kinds}) in {files}; "
            "--strict refuses them instead"
        )


# ------------------------------------------------------------------------ loading
def load_documents(
    files: Sequence[Path] | None,
    cache_dir: Path | None,
    text_field: str = "text",
    text_unit: str = "document",
    dataset: str | None = None,
    dataset_split: str = "train",
    report: BadRecords | None = None,
) -> Any:
    """One HF ``Dataset`` with a ``text`` column: every document of ``files`` in order (or of
    the HF dataset ``dataset``, a hub name or a local folder), cached under ``cache_dir``.

    Text files go through HF's ``text`` builder, Parquet files through its ``parquet`` builder
    and JSON files through its ``json`` builder. Where a JSON record is bad, HF fails the whole
    run of files without saying which line; those files are parsed again here, one line at a
    time, into ``Dataset.from_generator``, to skip (or, strict, refuse) each bad record by file
    and line. Bad records go to ``report``.
    """
    import datasets

    if text_unit not in TEXT_UNITS:
        raise ValueError(f"--text-unit {text_unit!r} is not one of {list(TEXT_UNITS)}")
    report = BadRecords() if report is None else report
    datasets.disable_progress_bars()
    parts = []
    if dataset is not None:
        cache = None if cache_dir is None else str(cache_dir)  # None: HF's default cache
        loaded = datasets.load_dataset(dataset, split=dataset_split, cache_dir=cache)
        parts.append(_text_rows(loaded, text_field, report, lambda i: (dataset, f"row {i}")))
    for reader, group in _runs_by_reader(files or []):
        if reader == "json":
            parts.append(_load_json(group, cache_dir, text_field, report))
            continue
        kwargs: dict[str, Any] = {"sample_by": text_unit, "keep_linebreaks": True}
        if reader == "parquet":  # only the text column: other columns may differ by file
            kwargs = {"columns": [text_field]}
        loaded = datasets.load_dataset(
            reader,
            data_files=[str(f) for f in group],
            split="train",
            cache_dir=str(cache_dir),
            **kwargs,
        )
        if reader == "text":  # text files have one column, "text", never null
            report.records += len(loaded)
            parts.append(loaded)
        else:
            parts.append(_text_rows(loaded, text_field, report, _parquet_rows(group)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _text_rows(loaded: Any, text_field: str, report: BadRecords, locate: Any) -> Any:
    """``loaded``'s text column as ``text``, its null rows skipped (``locate(i)`` names row
    ``i``'s source and place)."""
    import pyarrow.compute as pc

    if text_field not in loaded.column_names:
        raise ValueError(
            f"the documents have no column {text_field!r}; columns: {loaded.column_names}; "
            "name the text column with --text-field"
        )
    loaded = loaded.select_columns([text_field])
    if text_field != "text":
        loaded = loaded.rename_column(text_field, "text")
    column = loaded.data.column("text")
    report.records += len(column)
    if not _is_text_type(column.type):
        source, _ = locate(0)
        raise InputError(
            f"{source}: column {text_field!r} holds {column.type}, not text; name the text "
            "column with --text-field"
        )
    if column.null_count == 0:
        return loaded
    for i in np.flatnonzero(pc.is_null(column).to_numpy(zero_copy_only=False)):
        report.bad(*locate(int(i)), "null", f"{text_field!r} is null")
    keep = np.flatnonzero(pc.is_valid(column).to_numpy(zero_copy_only=False))
    return loaded.select(keep)


def _parquet_rows(files: Sequence[Path]) -> Any:
    """``row -> (file, "row k")`` over the rows of ``files`` read end to end."""
    import pyarrow.parquet as pq

    ends = np.cumsum([pq.read_metadata(f).num_rows for f in files])

    def locate(i: int) -> tuple[str, str]:
        n = int(np.searchsorted(ends, i, side="right"))
        return str(files[n]), f"row {i - (int(ends[n - 1]) if n else 0)}"

    return locate


def _load_json(files: Sequence[Path], cache_dir: Path | None, text_field: str,
               report: BadRecords) -> Any:  # fmt: skip
    import datasets

    clean = _load_clean_json(files, cache_dir, text_field)
    if clean is not None:
        report.records += len(clean)
        return clean
    features = datasets.Features({"text": datasets.Value("string")})
    kwargs = {"files": [str(f) for f in files], "text_field": text_field, "report": report}
    try:
        return datasets.Dataset.from_generator(
            _json_documents,
            features=features,
            gen_kwargs=kwargs,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, InputError):  # ours, naming file and line
            raise err.__cause__ from None
        raise


def _load_clean_json(files: Sequence[Path], cache_dir: Path | None, text_field: str) -> Any:
    """The files through HF's ``json`` builder (Arrow's reader: fast) when every record is an
    object whose text field is a string; None when any is not, and the caller parses them line
    by line to name the bad records."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load" lines
    try:
        loaded = datasets.load_dataset(
            "json",
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception:  # a line that is not JSON or not an object, types that differ by record
        return None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if text_field not in loaded.column_names:
        return None
    column = loaded.data.column(text_field)
    if not _is_text_type(column.type) or column.null_count:  # null: missing or null
        return None
    loaded = loaded.select_columns([text_field])
    return loaded if text_field == "text" else loaded.rename_column(text_field, "text")


def _json_documents(files: list[str], text_field: str, report: BadRecords) -> Iterator[dict]:
    """``{"text": ...}`` of every usable record of ``files``; a file none of whose records is
    usable is refused (a wrong ``--text-field`` more likely than a bad file)."""
    for name in files:
        path = Path(name)
        records, good, first, keys = 0, 0, None, None
        for where, record, problem in _json_records(path):
            records += 1
            if problem is None:
                if not isinstance(record, dict):
                    problem = ("not an object", f"not a JSON object ({type(record).__name__})")
                else:
                    keys = list(record) if keys is None else keys
                    value = record.get(text_field)
                    if text_field not in record:
                        problem = ("missing field", f"no {text_field!r} field")
                    elif value is None:
                        problem = ("null", f"{text_field!r} is null")
                    elif not isinstance(value, str):
                        kind = type(value).__name__
                        problem = ("not a string", f"{text_field!r} is {kind}, not a string")
            if problem is not None:
                first = first or f"{where}: {problem[1]}"
                report.bad(str(path), where, *problem)
                continue
            good += 1
            yield {"text": value}
        report.records += records
        if records == 0:
            raise InputError(f"{path} holds no JSON records (only blank lines): remove it")
        if good == 0:
            hint = (
                f"its records' fields: {keys}; name the text field with --text-field"
                if keys is not None
                else "is it JSON lines? remove it from --input or fix it"
            )
            raise InputError(
                f"{path}: none of its {records} records has a usable {text_field!r} text "
                f"(first: {first}); {hint}"
            )


def _json_records(path: Path) -> Iterator[tuple[str, Any, tuple[str, str] | None]]:
    """``(where, record, problem)`` per record: JSON lines (blank lines skipped), or the
    items of a ``.json`` file that is one JSON array."""
    with _open_binary(path) as f:
        if reader_of(path) == "json" and ".json" in [s.lower() for s in path.suffixes[-2:]]:
            data = f.read()
            if data.lstrip().startswith(b"["):
                try:
                    items = json.loads(data)
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    yield "record 1", None, ("not JSON", f"not a JSON array ({err})")
                    return
                for i, item in enumerate(items, 1):
                    yield f"record {i}", item, None
                return
            lines: Any = io.BytesIO(data)  # lines end at \n only, as in JSON lines
        else:
            lines = f
        for number, raw in enumerate(lines, 1):
            if not raw or raw.isspace():
                continue
            where = f"line {number}"
            try:
                yield where, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError:
                yield where, None, ("not UTF-8", "not UTF-8 text (a binary file?)")
            except json.JSONDecodeError as err:
                yield where, None, ("not JSON", f"not JSON ({err.msg}, column {err.colno})")


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
