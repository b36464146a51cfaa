"""DeepSpeed's checkpoint directories, read as one plain ``state_dict``.

Lightning's DeepSpeed strategy writes a directory per checkpoint (one file of module states, one
optimizer shard per rank, the fp32 masters flattened into partitions); DeepSpeed's own
``zero_to_fp32`` reassembles them. Nothing is imported from DeepSpeed until a checkpoint is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def consolidated_state_dict(
    checkpoint_dir: str | os.PathLike, prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """A DeepSpeed checkpoint directory (any ZeRO stage) as one plain fp32 ``state_dict``.

    DeepSpeed's own ``zero_to_fp32`` logic reassembles the flat fp32 master partitions of every
    rank into full tensors; ``prefix`` (the LightningModule's attribute holding the network,
    ``model.`` for ``CausalLMTask``) is stripped so the result loads into the bare model.
    Keys outside ``prefix`` are dropped; pass ``prefix=""`` to keep the module's full names.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    path = Path(checkpoint_dir)
    if not (path / "latest").is_file() and not (path / "checkpoint").is_dir():
        raise FileNotFoundError(
            f"{path} is not a DeepSpeed checkpoint directory (no 'latest' file or 'checkpoint/' "
            "tag folder); Lightning writes one per .ckpt path when training with DeepSpeed"
        )
    tag = None if (path / "latest").is_file() else "checkpoint"
    full = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    return {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
