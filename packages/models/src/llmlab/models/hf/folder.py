"""A Hugging Face-format checkpoint folder, read tensor by tensor and slice by slice.

A folder holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file name}}``). A safetensors
file is an 8-byte little-endian header length ``N``, a JSON header (each tensor's dtype, shape
and ``[begin, end)`` byte offsets into the data) and the data. :class:`CheckpointFolder` checks
all of that when it opens the folder -- every file the index names exists, every header parses,
every tensor's bytes lie inside its file -- so a missing shard, a truncated file or a damaged
index is reported at once, in one line naming the file, before anything is loaded (and before
any process group starts).

Reading goes through ``safetensors``' ``get_slice``, which copies only the requested elements
out of the memory-mapped file: a tensor-parallel rank asks for its rows or columns, a pipeline
stage for its layers' tensors. :attr:`CheckpointFolder.bytes_read` counts the bytes handed out,
so a test can show that each rank read only its share.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read as asked: the message names the file."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or a :class:`CheckpointError` naming the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file, checked against the file's size."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated ({size:,} bytes) or not safetensors: its header claims "
                f"{n:,} bytes"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: damaged safetensors header ({err})") from err
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated: its header places tensor data up to byte {8 + n + end:,} but "
            f"the file holds {size:,} bytes"
        )
    for name, info in tensors.items():
        begin, stop = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= d
        if info["dtype"] in DTYPE_SIZES and stop - begin != numel * DTYPE_SIZES[info["dtype"]]:
            raise CheckpointError(
                f"{path}: damaged: tensor {name!r} of shape {info['shape']} {info['dtype']} "
                f"spans {stop - begin} bytes"
            )
    return tensors


class CheckpointFolder:
    """``config.json`` and the safetensors files of one checkpoint, checked on opening."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected an HF-format folder)")
        self.config = read_json(self.path / CONFIG)
        self.weight_map = self._weight_map()
        self.tensors: dict[str, dict[str, Any]] = {}  # name -> header entry (dtype, shape)
        for file in sorted(set(self.weight_map.values())):
            header = read_header(self.path / file)
            expected = {n for n, f in self.weight_map.items() if f == file}
            missing = sorted(expected - set(header))
            if missing:
                raise CheckpointError(
                    f"{self.path / file}: lacks {len(missing)} tensor(s) the index places there, "
                    f"e.g. {missing[0]!r}"
                )
            self.tensors.update({n: header[n] for n in expected})
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            data = read_json(index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: has no 'weight_map' of tensor name -> file")
            absent = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if absent:
                raise CheckpointError(
                    f"{self.path / absent[0]}: missing ({INDEX} names {len(absent)} absent "
                    f"shard(s): {', '.join(absent)})"
                )
            return dict(weight_map)
        single = self.path / SINGLE
        if not single.is_file():
            raise CheckpointError(
                f"{self.path}: no {SINGLE} and no {INDEX} (weights must be safetensors)"
            )
        return dict.fromkeys(read_header(single), SINGLE)

    # ------------------------------------------------------------------ reading
    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """Tensor ``name`` (or ``tensor[index]`` for a tuple of slices), reading only those
        elements from the file; the bytes are added to :attr:`bytes_read`."""
        self._entry(name)
        handle = self._handle(self.weight_map[name])
        if index:
            tensor = handle.get_slice(name)[index]
        else:
            tensor = handle.get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._handles[file]

    def total_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes the tensors ``names`` (default: all) occupy in the files."""
        chosen = self.tensors if names is None else names
        return sum(
            self.tensors[n]["data_offsets"][1] - self.tensors[n]["data_offsets"][0] for n in chosen
        )

    def dtype(self) -> torch.dtype | None:
        """The floating dtype the weights are stored in (the first floating tensor's)."""
        codes = {
            "F64": torch.float64,
            "F32": torch.float32,
            "F16": torch.float16,
            "BF16": torch.bfloat16,
        }
        for info in self.tensors.values():
            if info["dtype"] in codes:
                return codes[info["dtype"]]
        return None
