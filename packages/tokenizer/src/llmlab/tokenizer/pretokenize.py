"""Pre-tokenize and count: corpus -> {chunk: count}, the only thing BPE training needs.

Texts are consumed in batches, so memory is bounded by the distinct chunks plus a few batches
per worker, never by the corpus. With ``workers > 1`` the batches are dealt round-robin to
``workers - 1`` processes and this one (regex matching is the expensive part and releases
nothing in one process); each keeps its own counts and hands them back once at the end, because
merging a Counter into another is a Python-level loop per distinct chunk.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from llmlab.tokenizer.patterns import compiled

BATCH = 4096


Splitter = str | Callable[[str], list[str]]


def _count_batch(
    args: tuple[Splitter, list[str]], into: Counter[str] | None = None
) -> Counter[str]:
    """Count the chunks of ``texts`` into ``into`` (a new Counter by default) and return it.

    Identical texts (repeated lines, speaker names) are split once and weighted; the texts seen
    once, nearly all of them, are split and counted without a Python-level loop per chunk
    (``Counter.update`` of an iterable counts in C).
    """
    splitter, texts = args
    findall = compiled(splitter).findall if isinstance(splitter, str) else splitter
    chunks: Counter[str] = Counter() if into is None else into
    singles = []
    for text, n in Counter(texts).items():
        if n == 1:
            singles.append(text)
        else:
            for chunk in findall(text):
                chunks[chunk] += n
    split_batch = getattr(splitter, "split_batch", None)
    if split_batch is not None:  # a splitter that handles many texts in one call
        chunks.update(split_batch(singles))
    else:
        chunks.update(itertools.chain.from_iterable(map(findall, singles)))
    return chunks


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while batch := list(itertools.islice(it, size)):
        yield batch


def count_chunks(texts: Iterable[str], pattern: Splitter, workers: int = 1) -> Counter[str]:
    """Split every text with ``pattern`` (a regex, or a picklable ``text -> chunks`` function)
    and count the chunks."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total: Counter[str] = Counter()
    jobs = ((pattern, batch) for batch in _batches(texts, BATCH))
    if workers == 1:
        for job in jobs:
            _count_batch(job, into=total)
        return total
    return _count_parallel(pattern, jobs, workers, total)


def _worker(splitter: Splitter, inbox: Any, results: Any) -> None:
    """Count every batch from ``inbox`` until ``None``; send the counts (or the error) back."""
    counts: Counter[str] = Counter()
    try:
        while (batch := inbox.get()) is not None:
            _count_batch((splitter, batch), into=counts)
        results.put(("ok", counts))
    except BaseException as exc:  # reported in the parent, which raises it
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _count_parallel(
    pattern: Splitter, jobs: Iterator[tuple[Splitter, list[str]]], workers: int, total: Counter
) -> Counter[str]:
    ctx = multiprocessing.get_context("spawn" if _has_threads() else "fork")
    results = ctx.Queue()
    inboxes = [ctx.Queue(maxsize=4) for _ in range(workers - 1)]
    procs = [ctx.Process(target=_worker, args=(pattern, q, results), daemon=True) for q in inboxes]
    for proc in procs:
        proc.start()
    try:
        for i, job in enumerate(jobs):
            slot = i % workers
            if slot == 0:
                _count_batch(job, into=total)  # this process takes its share
            else:
                inboxes[slot - 1].put(job[1])
        for inbox in inboxes:
            inbox.put(None)
        for _ in procs:
            status, counts = results.get()
            if status != "ok":
                raise RuntimeError(f"a counting worker failed: {counts}")
            total.update(counts)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    return total


def _has_threads() -> bool:
    return threading.active_count() > 1


def iter_file_lines(paths: Iterable[str | Path]) -> Iterator[str]:
    """Lines of UTF-8 files with their line endings kept (HF's file trainer reads this way)."""
    for path in paths:
        with open(path, "rb") as f:  # binary: split on b"\n" only, keep "\r\n" intact
            for line in f:
                yield line.decode("utf-8")
