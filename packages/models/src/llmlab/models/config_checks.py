"""The checks every model config shares, each naming the bad value and what would be valid."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KERNEL_BACKENDS = ("torch", "triton", "cpu")


def check_positive_ints(config: Any, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{type(config).__name__}.{name} must be a positive integer, got {value!r}"
            )


def check_heads_divide(config: Any, hint: str = "") -> None:
    """``n_embd`` splits into ``n_head`` equal heads (else the head counts near it that do)."""
    if config.n_embd % config.n_head != 0:
        divisors = [h for h in range(1, config.n_embd + 1) if config.n_embd % h == 0]
        near = sorted(divisors, key=lambda h: abs(h - config.n_head))[:4]
        raise ValueError(
            f"{type(config).__name__}.n_embd={config.n_embd} is not divisible by "
            f"n_head={config.n_head}; valid n_head values near it: {sorted(near)}{hint}"
        )


def check_dropout_and_kernels(config: Any, backends: tuple[str, ...] = KERNEL_BACKENDS) -> None:
    """``backends``: the op tables that change something for this model (GPT has no op the
    ``"cpu"`` table replaces)."""
    name = type(config).__name__
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"{name}.dropout must be in [0, 1), got {config.dropout!r}")
    if config.kernels not in backends:
        raise ValueError(f"{name}.kernels={config.kernels!r} is not one of {list(backends)}")
