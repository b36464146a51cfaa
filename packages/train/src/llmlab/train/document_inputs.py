"""Which files ``llmlab.train.prepare`` reads, and the refusals no skipped record can fix.

* :func:`input_files` expands the ``--input`` globs and folders (sorted, in the order given) and
  refuses a glob that matches nothing or a file type HF ``datasets`` has no reader for here.
* :func:`check_inputs` refuses, before any work, what no record of a file can fix: an empty
  file, a binary (non-UTF-8) text file, a Parquet file that is not one or lacks a text column.

Apart from the loading (:mod:`llmlab.train.document_loading`) because these look at files, not
records. Import through :mod:`llmlab.train.documents`.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import logging
import lzma
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("llmlab.train.prepare")

READERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # .zst: zstandard's
NL = b"\n"


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
        log.warning(
            "warning: --input %r: skipped %d file(s) of other types: %s",
            pattern,
            len(others),
            shown,
        )
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
