"""``GPTConfig``: the GPT's hyper-parameters and the checks that name bad values (its own module
so that checkpoint conversion can read configs without importing the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmlab.models.config_checks import (
    KERNEL_BACKENDS,
    check_dropout_and_kernels,
    check_heads_divide,
    check_positive_ints,
)

__all__ = ["KERNEL_BACKENDS", "GPTConfig"]


@dataclass
class GPTConfig:
    """Hyper-parameters of the GPT. ``validate()`` is called on construction of a ``GPT``."""

    vocab_size: int = 256
    block_size: int = 256  # the longest sequence the position table covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    kernels: str = "torch"  # "torch" (PyTorch ops) or "triton" (llmlab.kernels)

    def validate(self) -> None:
        """Fail early, naming the bad value and what would be valid."""
        check_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        check_heads_divide(self)
        check_dropout_and_kernels(self, ("torch", "triton"))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
