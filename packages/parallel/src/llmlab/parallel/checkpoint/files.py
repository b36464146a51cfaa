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


def metadata(path: str | os.PathLike) -> Metadata:
    """The chunk index of a DCP checkpoint (every key, its global shape and dtype)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint: it has no {METADATA} file (an interrupted save "
            f"leaves a .{path.name}.partial folder instead)"
        )
    return FileSystemReader(path).read_metadata()


def load(
    state_dict: dict[str, Any], path: str | os.PathLike, group: dist.ProcessGroup | None = None
) -> None:
    """Fill ``state_dict`` in place from ``path``: each tensor (or ``ShardedView``) gets exactly
    the elements it covers, whatever layout wrote them; other values are replaced."""
    metadata(path)  # a clear error for a wrong path
    dcp.load(state_dict, checkpoint_id=Path(path), process_group=group)


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
    dcp.load(wanted, checkpoint_id=Path(path), no_dist=True)
    return {key[len(prefix) :]: value for key, value in wanted.items()}


def read_object(path: str | os.PathLike, key: str) -> Any:
    """One non-tensor value (saved replicated), read on one process."""
    md = metadata(path)
    if key not in md.state_dict_metadata:
        raise KeyError(f"{path} has no entry {key!r}")
    out: dict[str, Any] = {key: None}
    dcp.load(out, checkpoint_id=Path(path), no_dist=True)
    return out[key]
