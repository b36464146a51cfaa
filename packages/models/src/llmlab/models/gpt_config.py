"""``GPTConfig``: the GPT's hyper-parameters and the checks that name bad values (its own module
so that checkpoint conversion can read configs without importing the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KERNEL_BACKENDS = ("torch", "triton")


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
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]
            near = sorted(divisors, key=lambda h: abs(h - self.n_head))[:4]
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"valid n_head values near it: {sorted(near)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(
                f"GPTConfig.kernels={self.kernels!r} is not one of {list(KERNEL_BACKENDS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
