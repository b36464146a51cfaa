"""The one-file checkpoint (``torch.save``): written atomically, checked whole before a resume.

Writing. Lightning's ``TorchCheckpointIO`` serialises into memory, writes a temporary file in the
*system* temp dir (fsspec's transaction) and ``shutil.move``-s it over the target. When that temp
dir is on another filesystem than the run dir (``/tmp`` on tmpfs or a node-local disk, runs on a
shared filesystem: the usual cluster set-up) the move is a copy into the target path, so a writer
killed mid-copy leaves a truncated ``last.ckpt``; nothing is fsync-ed either, so a crash of the
machine can leave one too. :class:`AtomicCheckpointIO` writes the temporary file next to the
target, fsyncs it, and ``os.replace``-s it: a reader sees the previous checkpoint or the new one,
never a prefix. (A sharded checkpoint is atomic by its own rename: :mod:`.files`.)

Reading. ``torch.save`` writes a zip archive whose directory sits at the very end of the file, so
:func:`checkpoint_problem` can tell a truncated or foreign file from a good one by reading that
directory and the small pickle record, without loading a single tensor; for a folder it asks the
sharded format (:func:`.files.problem`) or checks DeepSpeed's files one by one.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from llmlab.parallel.checkpoint.files import is_sharded
from llmlab.parallel.checkpoint.files import problem as sharded_problem

ZIP_MAGIC = b"PK\x03\x04"


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the checkpoint at ``path``, as a phrase; ``None`` if it looks whole.

    A file must be a complete ``torch.save`` archive; a directory is either a sharded N-D
    checkpoint (``torch.distributed.checkpoint``: its index and every shard file it names) or
    DeepSpeed's layout (``.pt`` files that each are one).
    """
    path = Path(path)
    if is_sharded(path):
        return sharded_problem(path)
    if path.is_dir():
        files = sorted(path.rglob("*.pt"))
        if not files:
            return "is a directory with no checkpoint files (*.pt) in it"
        for file in files:
            problem = _file_problem(file)
            if problem is not None:
                return f"holds {file.relative_to(path)}, which {problem}"
        return None
    if not path.exists():
        return "does not exist"
    return _file_problem(path)


def _file_problem(path: Path) -> str | None:
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes): its writer stopped before writing anything"
    with path.open("rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC:
        return (
            f"is not a checkpoint: torch.save writes a zip archive (starting with {ZIP_MAGIC!r}) "
            f"and this file starts with {head!r}"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            records = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if not records:
                return "is a zip archive but not a torch.save file (it has no data.pkl record)"
            archive.read(records[0])  # the pickle (small): checks its CRC, not the tensors
    except zipfile.BadZipFile as err:
        return (
            f"is truncated or damaged ({size:,} bytes; {err}): the zip directory at its end is "
            "missing or broken, as a writer killed mid-save leaves it"
        )
    return None


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file at ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash of the machine
    finally:
        os.close(directory)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with :func:`atomic_torch_save` for local paths."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):  # remote: fsspec's own rules
            return super().save_checkpoint(checkpoint, path, storage_options)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(checkpoint, path)
