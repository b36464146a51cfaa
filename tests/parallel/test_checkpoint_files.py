"""Checkpoints are written atomically, and a damaged one is named before a resume starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from llmlab.parallel.checkpoint.torch_file import (
    AtomicCheckpointIO,
    atomic_torch_save,
    checkpoint_problem,
)
from tests.helpers.runs import REPO


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}, "global_step": 3}, path)
    return path


def test_a_whole_checkpoint_passes(good):
    assert checkpoint_problem(good) is None


def test_garbage_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "bad.ckpt"
    path.write_text("garbage\n")
    assert checkpoint_problem(path) == (
        "is not a checkpoint: torch.save writes a zip archive (starting with b'PK\\x03\\x04') and "
        "this file starts with b'garb'"
    )


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_checkpoint_is_reported_as_truncated(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[: int(len(data) * keep)])  # what a writer killed mid-save leaves
    problem = checkpoint_problem(good)
    assert problem is not None and problem.startswith("is truncated or damaged ("), problem


def test_empty_missing_and_foreign_zip_files(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert "is empty (0 bytes)" in checkpoint_problem(tmp_path / "empty.ckpt")
    assert checkpoint_problem(tmp_path / "nope.ckpt") == "does not exist"
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "hello")
    assert "not a torch.save file" in checkpoint_problem(tmp_path / "other.zip")


def test_a_checkpoint_directory_is_checked_file_by_file(tmp_path, good):
    """DeepSpeed writes a directory of .pt files; each must be whole."""
    ckpt = tmp_path / "last.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    assert "no checkpoint files" in checkpoint_problem(ckpt)
    (ckpt / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(good.read_bytes())
    assert checkpoint_problem(ckpt) is None
    (ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04")
    problem = checkpoint_problem(ckpt)
    assert problem.startswith("holds checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt, which ")


_WRITES: list[tuple[str, ...]] = []


def _record_writes(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str | Path) and "w" in str(args[1] or ""):
        _WRITES.append(("open", str(args[0])))
    elif event == "os.rename":
        _WRITES.append(("rename", str(args[0]), str(args[1])))


def test_the_checkpoint_path_itself_is_never_opened_for_writing(tmp_path, good, monkeypatch):
    """Only a temporary file next to it is written, then renamed over it: a reader sees the old
    checkpoint or the new one. (Lightning's own IO writes its temporary file in the system temp
    dir and ``shutil.move``-s it, which opens the target and copies when /tmp is another
    filesystem: /dev/shm here stands in for that.)"""
    if os.path.isdir("/dev/shm"):
        monkeypatch.setenv("TMPDIR", "/dev/shm")
    target = tmp_path / "checkpoints" / "last.ckpt"
    sys.addaudithook(_record_writes)  # audit hooks cannot be removed; it records into _WRITES
    _WRITES.clear()
    AtomicCheckpointIO().save_checkpoint({"global_step": 7}, target)
    writes, _WRITES[:] = list(_WRITES), []
    assert ("open", str(target)) not in writes
    renames = [w for w in writes if w[0] == "rename"]
    assert len(renames) == 1 and renames[0][2] == str(target)
    assert Path(renames[0][1]).parent == target.parent  # same filesystem: an atomic rename
    assert torch.load(target, weights_only=True) == {"global_step": 7}
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # no temporary left


KILLED_MID_SAVE = """
import os, signal, sys, torch
from llmlab.parallel.checkpoint.torch_file import atomic_torch_save

class KillOnPickle:  # the writer dies half-way through serialising the new checkpoint
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

path = sys.argv[1]
atomic_torch_save({"global_step": 1, "w": torch.ones(256, 256)}, path)
atomic_torch_save({"global_step": 2, "w": torch.zeros(256, 256), "x": KillOnPickle()}, path)
"""


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, str(path)], cwd=REPO, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert checkpoint_problem(path) is None
    assert torch.load(path, weights_only=True)["global_step"] == 1


def test_a_failed_save_removes_its_temporary_file(tmp_path, good):
    before = good.read_bytes()
    with pytest.raises(Exception, match=r"lambda|pickle|local object"):
        atomic_torch_save({"global_step": 2, "fn": lambda: None}, good)
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]
