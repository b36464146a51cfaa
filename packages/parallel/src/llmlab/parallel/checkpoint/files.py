"""Sharded checkpoints on disk: ``torch.distributed.checkpoint`` (DCP), written atomically.

Every rank writes only what it holds (one ``__<rank>_0.distcp`` file each, plus rank 0's
``.metadata`` index of every chunk), so no rank ever holds the whole model -- the wall that
consolidating onto rank 0 hits first. Reading works for any other layout: DCP's planner matches
the chunks a rank asks for against the chunks on disk and reads the overlaps.

Atomic: the ranks write into ``.<name>.partial`` beside the target; once every rank is done,
rank 0 moves any previous checkpoint aside, renames the new one into place and deletes the old
one. A crash mid-write leaves the previous checkpoint untouched (and a ``.partial`` folder that
the next save clears).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

METADATA = ".metadata"


def _is_rank0(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save(
    state_dict: dict[str, Any], path: str | os.PathLike, group: dist.ProcessGroup | None = None
) -> Path:
    """Write ``state_dict`` (this rank's part) to the DCP folder ``path``; a collective over
    ``group`` (default: every rank). Returns ``path``."""
    path = Path(path)
    partial = path.parent / f".{path.name}.partial"
    if _is_rank0(group):
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier(group)
    dcp.save(state_dict, checkpoint_id=partial, process_group=group)
    _barrier(group)  # every rank's file and rank 0's metadata are on disk
    if _is_rank0(group):
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return path


def _require_index(path: Path) -> None:
    if not (path / METADATA).is_file():
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint: it has no {METADATA} file (an interrupted save "
            f"leaves a .{path.name}.partial folder instead)"
        )


def metadata(path: str | os.PathLike) -> Metadata:
    """The chunk index of a DCP checkpoint (every key, its global shape and dtype). Reading it
    unpickles an entry per chunk (tens of ms for a small model): read it once per load."""
    path = Path(path)
    _require_index(path)
    return FileSystemReader(path).read_metadata()


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DCP checkpoint folder (as opposed to a ``torch.save`` file)."""
    return (Path(path) / METADATA).is_file()


def problem(path: str | os.PathLike) -> str | None:
    """What is wrong with the DCP folder ``path``, as a phrase; ``None`` if it looks whole:
    the index reads and every shard file it names is there, at least as long as it says. Reads
    no tensor."""
    path = Path(path)
    try:
        md = metadata(path)
    except FileNotFoundError as err:
        return str(err).removeprefix(f"{path} ")
    except Exception as err:  # a damaged index: pickle or format errors
        return f"has an unreadable {METADATA} ({type(err).__name__}: {err})"
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"lacks the shard file {name} that its {METADATA} names"
        size = file.stat().st_size
        if size < end:
            return f"holds {name} truncated to {size:,} bytes (its index needs {end:,})"
    return None


def load(
    state_dict: dict[str, Any], path: str | os.PathLike, group: dist.ProcessGroup | None = None
) -> None:
    """Fill ``state_dict`` in place from ``path``: each tensor (or ``ShardedView``) gets exactly
    the elements it covers, whatever layout wrote them; other values are replaced."""
    _require_index(Path(path))  # a clear error for a wrong path
    dcp.load(state_dict, checkpoint_id=Path(path), process_group=group)


def _load_on_one_process(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state_dict, checkpoint_id=Path(path), no_dist=True)


def read_full(path: str | os.PathLike, prefix: str) -> dict[str, Tensor]:
    """Every tensor under ``prefix`` (e.g. ``"model."``) in full, on one process, no group."""
    md = metadata(path)
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in md.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not wanted:
        raise KeyError(f"{path} holds no tensor under {prefix!r}")
    _load_on_one_process(wanted, path)
    return {key[len(prefix) :]: value for key, value in wanted.items()}


def read_object(path: str | os.PathLike, key: str) -> Any:
    """One non-tensor value (saved replicated), read on one process."""
    _require_index(Path(path))
    out: dict[str, Any] = {key: None}
    try:
        _load_on_one_process(out, path)
    except Exception as err:
        if key not in metadata(path).state_dict_metadata:
            raise KeyError(f"{path} has no entry {key!r}") from err
        raise
    return out[key]
