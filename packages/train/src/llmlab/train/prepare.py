"""``make data``: tokenize a corpus once into the shards that ``data=tokens`` memory-maps.

    python -m llmlab.train.prepare --input 'corpus/*.jsonl' [more globs or folders] \\
        --output data/web [--tokenizer bytes|tokenizer.json] [--num-proc 2] \\
        [--val-fraction 0.01] [--text-field text] [--text-unit document] [--strict]

nanoGPT's ``prepare.py`` idea, for any llmlab tokenizer and at any size: HF ``datasets`` reads
local text / JSONL / Parquet files (a folder: every such file under it; text files are one
document each, or one per paragraph or line with ``--text-unit``; JSONL / Parquet records one
each, from the ``--text-field``) or ``--dataset NAME`` from the hub (online), ``num_proc``
workers tokenize them in order, every document gets the end-of-document id, and the ids are
written to fixed-size ``uint16`` / ``uint32`` shards with a document index and a manifest
(:mod:`llmlab.train.shards`). A held-out fraction of the *documents* (chosen by a hash of
their text) goes to the validation split.

Bad records (a JSONL line that is not JSON, a missing, null or non-string text field) are
skipped, each named in a warning with its file and line, and counted in a summary; ``--strict``
refuses the first one instead. What no skipping can fix (an empty file, a binary file, a
Parquet file without the text column) is refused, by file, before any work.

Re-running with the same inputs and options does nothing (sizes and modification times are
compared, then contents where a time moved); a changed input file, tokenizer or option is named
and the dataset is rebuilt. A build goes to a temporary sibling directory that replaces the old
one only once complete, so an interrupted run never leaves a half-written dataset behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmlab.train.documents import (
    TEXT_UNITS,
    BadRecords,
    PrepareTokenizer,
    check_inputs,
    hash_fraction,
    input_files,
    load_documents,
    prepare_tokenizer,
    reader_of,
    tokenized_batches,
)
from llmlab.train.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    VERSION,
    DatasetError,
    ShardWriter,
    read_manifest,
    sha256_file,
    token_dtype,
    verify,
    write_json_atomic,
)

log = logging.getLogger("llmlab.train.prepare")

DEFAULT_SHARD_TOKENS = 2**26  # 128 MiB of uint16 per shard: few files, each mapped cheaply


@dataclass
class PrepareResult:
    output: Path
    manifest: dict[str, Any]
    built: bool  # False: it was up to date
    reasons: list[str]  # why it was (re)built


def prepare(
    inputs: Sequence[str] = (),
    output: str | os.PathLike = "data/tokens",
    tokenizer: str = "bytes",
    num_proc: int = 1,
    eos: str | None = None,
    text_field: str = "text",
    text_unit: str = "document",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = 0.01,
    dataset: str | None = None,
    dataset_split: str = "train",
    force: bool = False,
    progress: bool = True,
    strict: bool = False,
) -> PrepareResult:
    """Prepare ``inputs`` (globs or folders) or the HF ``dataset`` into ``output``; see the
    module doc. ``strict``: refuse the first bad record instead of skipping and counting it."""
    output = Path(output).resolve()
    if bool(inputs) == bool(dataset):
        raise ValueError("give either --input GLOB... or --dataset NAME, not both and not neither")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be a positive integer, got {shard_tokens!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction!r}")
    if text_unit not in TEXT_UNITS:
        raise ValueError(f"--text-unit {text_unit!r} is not one of {list(TEXT_UNITS)}")
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"--num-proc must be a positive integer, got {num_proc!r}")
    tok = prepare_tokenizer(tokenizer, eos)
    options = {
        "text_field": text_field,
        "text_unit": text_unit,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
    }
    files = input_files(inputs) if inputs else []
    report = BadRecords(strict=strict)
    documents = None
    if dataset:  # HF's own cache keeps it; its fingerprint says whether it changed
        documents = load_documents(
            None, None, text_field, text_unit, dataset, dataset_split, report=report
        )
        sources = [
            {"dataset": dataset, "split": dataset_split, "fingerprint": documents._fingerprint}
        ]
    else:
        sources = [_stat(f) for f in files]
    reasons = ["--force"] if force else stale(output, tok, options, sources)
    if strict and not reasons and (skipped := read_manifest(output).get("skipped_records")):
        reasons = [f"--strict, and the dataset skipped {skipped} bad record(s)"]  # to refuse them
    if not reasons:
        log.info("%s is up to date (same inputs, tokenizer and options): nothing to do", output)
        return PrepareResult(output, read_manifest(output), False, [])
    check_inputs(files, text_field)  # empty, binary or column-less files: refused before work
    log.info("preparing %s: %s", output, "; ".join(reasons))
    manifest = _build(output, files, documents, tok, options, sources, num_proc, progress, report)
    return PrepareResult(output, manifest, True, reasons)


def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def stale(
    output: Path, tok: PrepareTokenizer, options: dict[str, Any], sources: list[dict[str, Any]]
) -> list[str]:
    """Why ``output`` must be (re)built for these inputs; empty when it is up to date.

    Files whose modification time moved but whose contents did not (a ``touch``) are up to date;
    their new times are written back to the manifest so the next check is instant.
    """
    if not (output / MANIFEST).exists():
        if output.exists() and any(output.iterdir()):
            raise ValueError(
                f"--output {output} exists and is not a prepared dataset (no {MANIFEST}); "
                "choose a new or empty directory"
            )
        return ["new dataset"]
    try:
        old = read_manifest(output)
        verify(output, old, checksums=False)
    except DatasetError as err:
        return [f"the existing dataset is unusable ({err})"]
    reasons = []
    if old["tokenizer"]["fingerprint"] != tok.fingerprint:
        reasons.append(
            f"tokenizer changed (fingerprint {old['tokenizer']['fingerprint']} -> "
            f"{tok.fingerprint})"
        )
    for key, value in options.items():
        if old["options"].get(key) != value:
            reasons.append(f"{key} changed ({old['options'].get(key)!r} -> {value!r})")
    before = {s.get("path", s.get("dataset")): s for s in old["sources"]}
    now = {s.get("path", s.get("dataset")): s for s in sources}
    reasons += [f"input removed: {p}" for p in before if p not in now]
    reasons += [f"input added: {p}" for p in now if p not in before]
    if [*before] != [*now] and not reasons:
        reasons.append("inputs reordered")
    touched = False
    for key, src in now.items():
        was = before.get(key)
        if was is None:
            continue
        if "dataset" in src:
            if src["fingerprint"] != was["fingerprint"]:
                reasons.append(f"dataset {key} changed (fingerprint)")
        elif src["bytes"] != was["bytes"]:
            reasons.append(f"input changed: {key} ({was['bytes']} -> {src['bytes']} bytes)")
        elif src["mtime_ns"] != was["mtime_ns"]:
            src["sha256"] = sha256_file(key)
            if src["sha256"] != was["sha256"]:
                reasons.append(f"input changed: {key} (contents)")
            else:
                was["mtime_ns"], touched = src["mtime_ns"], True
    if not reasons and touched:
        write_json_atomic(output / MANIFEST, old)
    return reasons


def _build(
    output: Path,
    files: list[Path],
    documents: Any,
    tok: PrepareTokenizer,
    options: dict[str, Any],
    sources: list[dict[str, Any]],
    num_proc: int,
    progress: bool,
    report: BadRecords,
) -> dict[str, Any]:
    work = output.with_name(f".{output.name}.building-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        for src in sources:
            if "path" in src:
                src["sha256"] = sha256_file(src["path"])
        if documents is None:
            field, unit = options["text_field"], options["text_unit"]
            documents = load_documents(files, work / ".hf-cache", field, unit, report=report)
        if summary := report.summary():
            log.warning("warning: %s", summary)
        if len(documents) == 0:
            raise ValueError(no_document_advice(files, options, report))
        dtype = token_dtype(tok.entry["vocab_size"])
        writers = {s: ShardWriter(work, s, dtype, options["shard_tokens"]) for s in SPLITS}
        stats = _write(documents, tok, dtype, options["val_fraction"], writers, num_proc, progress)
        splits = {s: w.close() for s, w in writers.items()}
        for split, entry in splits.items():
            if entry["documents"] == 0:
                raise ValueError(split_advice(documents, split, options, files))
        tokenizer = dict(tok.entry)
        if tokenizer["kind"] == "file":  # a copy travels with the shards
            from llmlab.tokenizer import save

            save(tok.tokenizer, work / "tokenizer.json")
            tokenizer["file"] = "tokenizer.json"
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tokenizer,
            "dtype": dtype.name,
            "options": options,
            "sources": sources,
            "text_bytes": stats["text_bytes"],
            "skipped_records": report.skipped,
            "splits": splits,
        }
        del documents
        shutil.rmtree(work / ".hf-cache", ignore_errors=True)
        write_json_atomic(work / MANIFEST, manifest)
        _replace(work, output)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    rate = stats["text_bytes"] / 1e6 / max(stats["seconds"], 1e-9)
    log.info(
        "prepared %d documents, %d tokens (train %d, validation %d) from %.1f MB of text in "
        "%.1fs (%.1f MB/s, %d processes) -> %s",
        sum(s["documents"] for s in splits.values()),
        sum(s["tokens"] for s in splits.values()),
        splits["train"]["tokens"],
        splits["validation"]["tokens"],
        stats["text_bytes"] / 1e6,
        stats["seconds"],
        rate,
        num_proc,
        output,
    )
    return manifest


# ------------------------------------------------------------------------- advice
VAL_FRACTIONS = sorted(
    {round(m * 10.0**-e, e) for e in range(1, 7) for m in (1, 2, 5)}
    | {0.3, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99}
)


def _finer_unit(files: Sequence[Path], text_unit: str) -> str | None:
    """Advice that cuts the text files into more documents, if a finer ``--text-unit`` can."""
    if not any(reader_of(f) == "text" for f in files):
        return None
    if text_unit == "document":
        return "split the text files into more documents with --text-unit paragraph (or line)"
    if text_unit == "paragraph":
        return "split the text files into more documents with --text-unit line"
    return None


def no_document_advice(files: Sequence[Path], options: dict[str, Any], report: BadRecords) -> str:
    """Why the inputs gave no document at all, and what would give some."""
    if report.skipped:
        return f"the inputs hold no usable document: every record was bad ({report.summary()})"
    if options["text_unit"] != "document" and any(reader_of(f) == "text" for f in files):
        return (
            f"the inputs hold no document: the text files hold no {options['text_unit']} with "
            "text; use --text-unit document"
        )
    return "the inputs hold no document: give files with text in them"


def split_advice(documents: Any, split: str, options: dict[str, Any], files: Sequence[Path]) -> str:
    """Why a split got no document, with a change that fills both: a finer ``--text-unit``
    where there are too few distinct documents, else the ``--val-fraction`` that puts at
    least one of these documents on each side (documents go whole to a split, by
    :func:`~llmlab.train.documents.hash_fraction` < val_fraction)."""
    n, fraction = len(documents), options["val_fraction"]
    head = f"no document went to the {split} split ({n} document(s), --val-fraction {fraction})"
    finer = _finer_unit(files, options["text_unit"])
    if n == 1:
        return f"{head}: one document cannot fill two splits; {finer or 'give more documents'}"
    places = [
        hash_fraction(text.encode("utf-8"))
        for start in range(0, n, 1024)
        for text in documents[start : start + 1024]["text"]
    ]
    low, high = min(places), max(places)
    if low == high:
        return (
            f"{head}: all {n} documents are the same text, so they go to the same split; "
            f"{finer or 'give different documents'}"
        )
    # validation gets a document iff low < val_fraction; train keeps one iff val_fraction <= high
    fits = [v for v in VAL_FRACTIONS if low < v <= high]
    if fits:
        value = fits[0] if split == "validation" else fits[-1]
    else:
        middle = (low + high) / 2
        value = next(
            float(f"{middle:.{p}g}") for p in range(1, 18) if low < float(f"{middle:.{p}g}") <= high
        )
    return (
        f"{head}: use --val-fraction {value}, which puts at least one of these {n} documents in "
        "each split (a document goes whole to one split, by a hash of its text)"
        + (f"; or {finer}" if finer else "")
    )


def _write(documents, tok, dtype, val_fraction, writers, num_proc, progress) -> dict[str, Any]:
    from tqdm.auto import tqdm

    start, text_bytes = time.perf_counter(), 0
    bar = tqdm(
        desc="tokenizing", unit="tok", unit_scale=True, disable=not progress, file=sys.stderr
    )
    with bar:
        for batch in tokenized_batches(documents, tok, dtype, val_fraction, num_proc):
            for split, writer in writers.items():
                writer.add(*batch.split(validation=split == "validation"))
            text_bytes += batch.text_bytes
            bar.update(len(batch.ids))
            bar.set_postfix_str(f"{text_bytes / 1e6 / (time.perf_counter() - start):.1f} MB/s")
    return {"text_bytes": text_bytes, "seconds": time.perf_counter() - start}


def _replace(work: Path, output: Path) -> None:
    """Swap the finished build in: the old dataset (if any) is moved aside, then removed."""
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.replace(output, old)
    os.replace(work, output)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m llmlab.train.prepare",
        description="Tokenize text/JSONL/Parquet files into shards for data=tokens.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input",
        nargs="+",
        metavar="GLOB",
        help="files or folders to read (quote globs); a folder: every text / JSONL / Parquet "
        "file under it",
    )
    src.add_argument("--corpus", help="a corpus that ships with llmlab: shakespeare")
    src.add_argument("--dataset", help="an HF dataset name (needs the network) or local folder")
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer file")
    p.add_argument("--eos", help="the end-of-document special token (tokenizer files)")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes")
    p.add_argument("--text-field", default="text", help="the text field of JSONL / Parquet records")
    p.add_argument(
        "--text-unit",
        default="document",
        choices=TEXT_UNITS,
        help="what one document of a text file is: the whole file, a paragraph (text between "
        "blank lines) or a line",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse the first bad record (a line that is not JSON, a missing, null or "
        "non-string text field) instead of skipping and counting it",
    )
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    inputs = args.input or []
    try:
        if args.corpus:
            from llmlab.train.corpora import corpus_files

            splits = corpus_files(args.corpus)
            inputs = sorted(f for files in splits.values() for f in files)
        prepare(
            inputs,
            args.output,
            tokenizer=args.tokenizer,
            num_proc=args.num_proc,
            eos=args.eos,
            text_field=args.text_field,
            text_unit=args.text_unit,
            shard_tokens=args.shard_tokens,
            val_fraction=args.val_fraction,
            dataset=args.dataset,
            dataset_split=args.dataset_split,
            force=args.force,
            progress=not args.no_progress,
            strict=args.strict,
        )
    except ValueError as err:  # DatasetError and InputError included
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from datasets.exceptions import DatasetGenerationError

        if not isinstance(err, DatasetGenerationError):
            raise
        cause = err.__cause__ or err  # HF's own wrapper says nothing about which file or why
        print(f"error: HF datasets could not read the inputs: {cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
