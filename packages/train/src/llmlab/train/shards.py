"""The on-disk format of a prepared token dataset: fixed-size shards, a document index, a manifest.

``python -m llmlab.train.prepare`` writes, and ``data=tokens`` reads, one directory::

    manifest.json              tokenizer (fingerprint, vocabulary, end-of-document id), sources
                               (path, bytes, sha256), options, and per split its shards and index
    train/shard_00000.bin ...  token ids, raw little-endian uint16 (vocabulary <= 65,536) or uint32,
                               ``shard_tokens`` per file (the last one shorter): nanoGPT's memmap
    train/documents.npy        int64 offsets: document ``d`` is tokens ``[o[d], o[d+1])`` of the
                               split's stream, its last token the end-of-document id (which
                               occurs nowhere else, so a window's documents can be read off
                               its own tokens)
    validation/...             the same for the documents held out for validation

Shards are plain arrays so that any reader (``numpy.memmap``, C, Rust) can use them; the manifest
holds every file's size and sha256, so a truncated or corrupted file is named before training
starts (:func:`verify`). :class:`TokenStore` reads a split memory-mapped: a read copies only the
tokens asked for and then drops the mapping's pages from this process (``MADV_DONTNEED``; the
kernel's page cache keeps them), so resident memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT, VERSION = "llmlab-tokens", 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
INDEX = "documents.npy"
RELEASE_ALIGN = 1 << 21  # 2 MiB: covers fault-around (64 KiB) and large page-cache folios


class DatasetError(ValueError):
    """A prepared dataset that cannot be used: missing, from another tokenizer, or damaged."""


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocabulary <= 65,536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The file's sha256, read into one reused buffer (no allocation per chunk)."""
    digest, buffer = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the prepared dataset at ``root``, or a :class:`DatasetError` saying why
    there is none."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DatasetError(
            f"{root} is not a prepared token dataset (no {MANIFEST}); prepare one with "
            f"`make data INPUT='<files>' OUTPUT={root}` (python -m llmlab.train.prepare)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path} is not valid JSON ({err}); re-run make data") from err
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DatasetError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('version')!r}, "
            f"this llmlab reads {FORMAT!r} v{VERSION}; re-run make data"
        )
    return manifest


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------- writing
class ShardWriter:
    """Appends documents' token ids to one split: fixed-size shards plus the document index.

    ``add(ids, lengths)`` takes a batch of documents as one flat array and their lengths (end of
    document tokens already appended), writes whole shards as they fill, and keeps the
    documents' end offsets; ``close()`` writes the last shard and ``documents.npy`` and returns
    the split's manifest entry.
    """

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.dtype = root, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        (root / split).mkdir(parents=True, exist_ok=True)
        self.shards: list[dict[str, Any]] = []
        self.ends: list[np.ndarray] = []
        self.tokens = 0
        self._file: Any = None
        self._digest: Any = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        if len(lengths) == 0:
            return
        self.ends.append(self.tokens + np.cumsum(lengths, dtype=np.int64))
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        while len(ids):
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._in_shard
            part, ids = ids[:room], ids[room:]
            self._file.write(part.tobytes())
            self._digest.update(part.tobytes())
            self._in_shard += len(part)
            self.tokens += len(part)
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _open(self) -> None:
        name = f"{self.split}/shard_{len(self.shards):05d}.bin"
        self._file = open(self.root / name, "wb")  # noqa: SIM115 -- closed by _close_shard
        self._digest = hashlib.sha256()
        self._in_shard = 0
        self.shards.append({"file": name})

    def _close_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(tokens=self._in_shard, sha256=self._digest.hexdigest())
        self._file = None

    def close(self) -> dict[str, Any]:
        if self._file is not None:
            self._close_shard()
        offsets = np.concatenate([np.zeros(1, np.int64), *self.ends])
        index = f"{self.split}/{INDEX}"
        np.save(self.root / index, offsets)
        return {
            "tokens": int(self.tokens),
            "documents": int(len(offsets) - 1),
            "shards": self.shards,
            "index": {"file": index, "sha256": sha256_file(self.root / index)},
        }


# ------------------------------------------------------------------------------ checking
def verify(root: str | os.PathLike, manifest: dict[str, Any], checksums: bool) -> None:
    """Refuse a damaged dataset, naming the file: every shard and index must exist with the
    manifest's size (and, with ``checksums``, its sha256); the index must end at the split's
    token count."""
    root = Path(root)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, entry in manifest["splits"].items():
        for shard in entry["shards"]:
            path = root / shard["file"]
            expected = shard["tokens"] * itemsize
            _check_file(path, expected, shard["sha256"] if checksums else None)
        index = root / entry["index"]["file"]
        _check_file(index, None, entry["index"]["sha256"] if checksums else None)
        offsets = np.load(index, mmap_mode="r")
        if len(offsets) != entry["documents"] + 1 or int(offsets[-1]) != entry["tokens"]:
            raise DatasetError(
                f"{index} does not match the manifest: {len(offsets) - 1} documents ending at "
                f"token {int(offsets[-1])}, manifest says {entry['documents']} and "
                f"{entry['tokens']} ({split}); re-run make data"
            )


def _check_file(path: Path, size: int | None, sha256: str | None) -> None:
    if not path.is_file():
        raise DatasetError(f"{path} is missing; re-run make data")
    actual = path.stat().st_size
    if size is not None and actual != size:
        what = "truncated" if actual < size else "longer than written"
        raise DatasetError(
            f"{path} is {what}: {actual} bytes, the manifest says {size}; re-run make data"
        )
    if sha256 is not None and sha256_file(path) != sha256:
        raise DatasetError(
            f"{path} is corrupted: its sha256 differs from the manifest's; re-run make data"
        )


# ------------------------------------------------------------------------------- reading
@dataclass
class _Shard:
    start: int  # first token's index in the split's stream
    tokens: int
    path: Path
    view: np.ndarray | None = None
    map: mmap.mmap | None = None


class TokenStore:
    """One split of a prepared dataset, memory-mapped: the token stream and its documents."""

    def __init__(self, root: str | os.PathLike, manifest: dict[str, Any], split: str) -> None:
        root = Path(root)
        entry = manifest["splits"][split]
        self.dtype = np.dtype(manifest["dtype"])
        self.eos_token_id = int(manifest["tokenizer"]["eos_token_id"])
        self.tokens = int(entry["tokens"])
        self.offsets = np.load(root / entry["index"]["file"], mmap_mode="r")
        self.shards: list[_Shard] = []
        start = 0
        for shard in entry["shards"]:
            self.shards.append(_Shard(start, int(shard["tokens"]), root / shard["file"]))
            start += int(shard["tokens"])
        self._starts = np.array([s.start for s in self.shards], dtype=np.int64)

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """A copy of tokens ``[start, stop)`` of the stream (across shard boundaries)."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the split's {self.tokens}")
        out = np.empty(stop - start, dtype=self.dtype)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            shard = self.shards[i]
            lo, hi = pos - shard.start, min(stop, shard.start + shard.tokens) - shard.start
            out[pos - start : pos - start + hi - lo] = self._view(shard)[lo:hi]
            self._release(shard, lo, hi)
            pos += hi - lo
            i += 1
        return out

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) copies of tokens ``[s, s + length)`` for each start ``s``:
        one gather per shard for the windows inside it (a window across a boundary: ``read``)."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=self.dtype)
        shard_of = np.searchsorted(self._starts, starts, side="right") - 1
        ends_of = self._starts[shard_of] + np.array([self.shards[i].tokens for i in shard_of])
        inside = starts + length <= ends_of
        for i in np.unique(shard_of[inside]):
            rows = np.flatnonzero(inside & (shard_of == i))
            shard = self.shards[int(i)]
            local = starts[rows] - shard.start
            out[rows] = self._view(shard)[local[:, None] + np.arange(length)]
            self._release(shard, local, local + length)
        for row in np.flatnonzero(~inside):
            out[row] = self.read(int(starts[row]), int(starts[row]) + length)
        return out

    def _view(self, shard: _Shard) -> np.ndarray:
        if shard.view is None:
            with open(shard.path, "rb") as f:
                shard.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            shard.view = np.frombuffer(shard.map, dtype=self.dtype, count=shard.tokens)
        return shard.view

    def _release(self, shard: _Shard, lo: Any, hi: Any) -> None:
        """Unmap the pages around tokens ``[lo[i], hi[i])`` of ``shard`` from this process (the
        page cache keeps them). "Around": a page fault maps its neighbours too (fault-around,
        64 KiB, and whole large page-cache folios on recent kernels), so each range released is
        widened to ``RELEASE_ALIGN`` on both sides."""
        if shard.map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        size = self.dtype.itemsize
        first = np.atleast_1d(lo) * size // RELEASE_ALIGN
        last = -(-(np.atleast_1d(hi) * size) // RELEASE_ALIGN)  # ceil: the chunk after the end
        for a, b in set(zip(first.tolist(), last.tolist(), strict=True)):
            begin = a * RELEASE_ALIGN
            shard.map.madvise(
                mmap.MADV_DONTNEED, begin, min(b * RELEASE_ALIGN, len(shard.map)) - begin
            )

    def document(self, d: int) -> np.ndarray:
        """The token ids of document ``d`` (its end-of-document token last)."""
        return self.read(int(self.offsets[d]), int(self.offsets[d + 1]))
