"""Documents read into one HF ``Dataset``, with bad records skipped and counted (or refused).

:func:`load_documents` reads the input files with HF ``datasets`` (``text``: one document per
file by default, or per paragraph / line; ``json`` / ``parquet``: one per record, from a text
field) into one Arrow table of documents, in input order. A bad record (a line that is not JSON,
a missing, null or non-string text field) is skipped and counted in :class:`BadRecords`, which
warns with its file and line -- or, ``strict``, refused with that file and line.

Import through :mod:`llmlab.train.documents`.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmlab.train.document_inputs import InputError, _is_text_type, _open_binary, reader_of

log = logging.getLogger("llmlab.train.prepare")

TEXT_UNITS = ("document", "paragraph", "line")
MAX_WARNINGS = 20  # bad records named one by one; the rest are counted in the summary


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


def _load_json(
    files: Sequence[Path], cache_dir: Path | None, text_field: str, report: BadRecords
) -> Any:
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
