"""Chat and preference data's records: JSON objects read through HF ``datasets``, each with
its source, place and split.

Shared by :mod:`llmlab.train.chat` and :mod:`llmlab.train.preference`, which differ in what a
record holds (a conversation, a preference pair) but read and split their files alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmlab.train.document_loading import _json_records
from llmlab.train.documents import BadRecords, InputError, in_validation, input_files


@dataclass
class Record:
    """One usable record: its parsed JSON, where it came from, and its split."""

    value: dict[str, Any]
    source: str
    where: str
    validation: bool


def read_records(
    files: Sequence[str | Path],
    report: BadRecords,
    val_fraction: float = 0.0,
    cache_dir: str | Path | None = None,
) -> list[Record]:
    """Every JSON-object record of ``files`` (JSON lines, or ``.json`` arrays), through HF
    ``datasets`` (one Arrow table, cached under ``cache_dir`` by the files' contents); a line
    that is not a JSON object is skipped and reported by file and line (``report``)."""
    import datasets

    if not files:
        return []
    paths = [str(p) for p in input_files([str(f) for f in files])]
    stamp = hashlib.sha1()
    for p in paths:  # the cache key: names and contents (a changed file is read again)
        stamp.update(p.encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                stamp.update(block)
    datasets.disable_progress_bars()
    features = datasets.Features(
        {k: datasets.Value("string") for k in ("record", "source", "where", "problem")}
    )
    table = datasets.Dataset.from_generator(
        _json_lines,
        features=features,
        gen_kwargs={"files": paths, "stamp": stamp.hexdigest()},
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
    records = []
    for row in table:
        report.records += 1
        if row["problem"]:
            kind, detail = row["problem"].split("\0")
            report.bad(row["source"], row["where"], kind, detail)
            continue
        raw = row["record"]
        records.append(
            Record(
                json.loads(raw),
                row["source"],
                row["where"],
                in_validation(raw.encode("utf-8"), val_fraction),
            )
        )
    return records


def _json_lines(files: list[str], stamp: str) -> Iterator[dict[str, str]]:
    """Rows of :func:`read_records`' table (``stamp`` only keys the cache)."""
    for name in files:
        for where, value, problem in _json_records(Path(name)):
            if problem is None and not isinstance(value, dict):
                problem = ("not an object", f"not a JSON object ({type(value).__name__})")
            yield {
                "record": "" if problem else json.dumps(value, ensure_ascii=False),
                "source": name,
                "where": where,
                "problem": "\0".join(problem) if problem else "",
            }


def files_list(files: str | Sequence[str] | None) -> list[str]:
    if files is None:
        return []
    return [files] if isinstance(files, str) else [str(f) for f in files]


def read_split_records(
    files: str | Sequence[str],
    val_files: str | Sequence[str] | None,
    val_fraction: float,
    report: BadRecords,
    cache_dir: str | None = None,
) -> list[Record]:
    """The records of ``files`` then of ``val_files``, those marked ``validation`` (without
    ``val_files``, a ``val_fraction`` of ``files`` by hash): how chat and preference data read
    their splits. A bad input file is a ``ValueError``, as a bad config value is."""
    fraction = 0.0 if val_files else val_fraction
    try:
        train = read_records(files_list(files), report, fraction, cache_dir)
        val = read_records(files_list(val_files), report, 0.0, cache_dir)
    except InputError as err:
        raise ValueError(str(err)) from err
    for r in val:
        r.validation = True
    return train + val
