"""A Hugging Face-format folder as a source of weights *by llmlab name*, read a piece at a time.

``from_pretrained`` reads every tensor into a whole model. A parallel layout needs less: a
pipeline stage only its layers, a tensor-parallel rank only its slice of each sharded tensor.
:class:`PretrainedWeights` is what such a layout reads from: ``read(name, part)`` returns the
llmlab tensor ``name`` (a state-dict key of the unsplit model), whole or part ``index`` of
``count`` equal parts along ``dim`` -- ``chunk(count, dim)[index]``, the slice
``llmlab.parallel.tensor`` gives a rank -- reading only those bytes from the safetensors files.
It meets the ``WeightSource`` contract of ``llmlab.parallel.contracts`` structurally (this module
imports nothing from ``llmlab.parallel``).

:func:`build_model_unloaded` is how a trainer defers the reading: the model of the folder on the
``meta`` device (its shape, no memory) and the source to fill it from once the layout is known.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.hf.folder import CheckpointError, CheckpointFolder
from llmlab.models.hf.loading import checkpoint_sources
from llmlab.models.hf.weights import Shard, read_tensor

POSITION_TABLE = "embed.wpe.weight"  # GPT: a shorter context keeps the table's first rows


class PretrainedWeights:
    """The tensors of the HF folder ``path`` for the llmlab model ``config`` describes.

    ``bytes_read`` counts what was read so far (:attr:`CheckpointFolder.bytes_read`), so a
    caller can show that each rank read only its share; ``total_bytes(names)`` is what those
    tensors occupy in the files.
    """

    def __init__(self, path: str | Path, config: Any) -> None:
        self.folder = CheckpointFolder(path)
        self.config = config
        self.sources = checkpoint_sources(self.folder, config)

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def bytes_read(self) -> int:
        return self.folder.bytes_read

    def dtype(self) -> torch.dtype | None:
        """The floating dtype the weights are stored in."""
        return self.folder.dtype()

    def names(self) -> list[str]:
        """Every llmlab tensor name the folder provides (a tied weight under each name)."""
        return list(self.sources)

    def read(self, name: str, part: tuple[int, int, int] | None = None) -> Tensor:
        """llmlab tensor ``name``, or ``part = (dim, index, count)`` of it, reading only those
        bytes (module docstring)."""
        if name not in self.sources:
            raise CheckpointError(
                f"{self.path}: provides no tensor for llmlab parameter {name!r} "
                f"(its tensors cover {len(self.sources)} names, e.g. {next(iter(self.sources))!r})"
            )
        source = self.sources[name]
        if name == POSITION_TABLE:  # replicated by every plan: the first block_size rows
            if part is not None:
                raise ValueError(f"{name}: the position table is read whole, not {part}")
            return self.folder.read(source.hf_name, (slice(0, self.config.block_size),))
        return read_tensor(self.folder, source, None if part is None else Shard(*part))

    def total_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes the llmlab tensors ``names`` (default: all) occupy in the files, each HF tensor
        once (a tied weight has two names and one tensor)."""
        chosen = self.sources if names is None else names
        return self.folder.total_bytes({h for n in chosen for h in self.sources[n].hf_names})


def build_model_unloaded(spec: Mapping[str, Any]) -> tuple[nn.Module, PretrainedWeights | None]:
    """``build_model(spec)``, except that with ``spec["init_from"]`` the model is built on the
    ``meta`` device in the folder's dtype and returned with the :class:`PretrainedWeights` to
    fill it from (``llmlab.parallel.checkpoint.pretrained.load_pretrained``); without
    ``init_from``, the built model and ``None``."""
    from llmlab.models.registry import INIT_FROM, build_model

    if not spec.get(INIT_FROM):
        return build_model(spec), None
    with torch.device("meta"):
        model = build_model(spec)
    weights = PretrainedWeights(spec[INIT_FROM], model.config)
    dtype = weights.dtype()
    if dtype is not None:
        model = model.to(dtype=dtype)  # as from_pretrained keeps it: the dtype of the files
    return model, weights
