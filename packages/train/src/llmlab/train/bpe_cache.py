"""A BPE tokenizer for training runs: learned from the corpus's train split once, then reused.

``conf/tokenizer/bpe.yaml`` points Hydra here. The learned tokenizer is cached under the run
cache dir as ``tokenizers/bpe-<key>.json`` (llmlab's readable format), where the key hashes the
settings and the training files' names, sizes and contents: change any of them and a new
tokenizer is trained; change nothing and the next run loads it in well under a second.
Only the train split is used, so validation loss is measured on text the tokenizer never saw.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from llmlab.tokenizer import BPETokenizer, load, save
from llmlab.tokenizer.pretokenize import iter_file_lines
from llmlab.train.data import corpus_files

log = logging.getLogger(__name__)


def _files_digest(files: Sequence[str]) -> list[tuple[str, int, str]]:
    out = []
    for f in files:
        data = Path(f).read_bytes()
        out.append((Path(f).name, len(data), hashlib.sha1(data).hexdigest()))
    return out


def _limited_lines(files: Sequence[str], max_bytes: int | None) -> Iterator[str]:
    used = 0
    for line in iter_file_lines(files):
        if max_bytes is not None and used >= max_bytes:
            return
        used += len(line.encode("utf-8"))
        yield line


def load_or_train_bpe(
    vocab_size: int = 4096,
    pattern: str = "gpt4",
    corpus: str = "shakespeare",
    cache_dir: str = ".cache/llmlab",
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    min_frequency: int = 0,
    max_bytes: int | None = None,
    workers: int = 1,
) -> BPETokenizer:
    """The BPE tokenizer for these settings: from the cache, or trained now and cached.

    ``max_bytes`` caps the training text (first lines of the train split) for quick runs.
    """
    files = corpus_files(corpus)["train"]
    settings = {
        "version": 1,
        "vocab_size": vocab_size,
        "pattern": pattern,
        "corpus": corpus,
        "special_tokens": list(special_tokens),
        "min_frequency": min_frequency,
        "max_bytes": max_bytes,
        "files": _files_digest(files),
    }
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{key}.json"
    if path.is_file():
        log.info("BPE tokenizer: cached %s", path)
        return load(path)
    start = time.perf_counter()
    tok = BPETokenizer.train(
        _limited_lines(files, max_bytes),  # line by line, like HF's file trainer
        vocab_size,
        pattern=pattern,
        special_tokens=special_tokens,
        min_frequency=min_frequency,
        workers=workers,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save(tok, tmp)
    os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
    log.info(
        "BPE tokenizer: trained %d ids on %s in %.1fs -> %s",
        tok.vocab_size,
        corpus,
        time.perf_counter() - start,
        path,
    )
    return tok
