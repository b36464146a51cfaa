"""Per-rank random streams for dropout inside tensor-parallel (and sequence-parallel) regions.

Outside a tensor-parallel region every rank holds the same activations, so dropout there must
draw the *same* mask on every rank: it uses the default generator, seeded identically. Inside a
region (sharded heads, or sequence shards under sequence parallelism) each rank holds different
elements, and identical masks would correlate them: dropout there draws from a second stream,
seeded ``seed + 2718 + tp_rank`` as Megatron-LM does. ``TensorParallelRNG.fork()`` swaps that
stream in for the duration of a block and keeps its advanced state for the next time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    """A saved RNG state (CPU, and CUDA when present) that ``fork()`` swaps in and out."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        previous = _get_states()
        torch.manual_seed(self.seed)
        self._states = _get_states()
        _set_states(previous)
        self._depth = 0

    @contextmanager
    def fork(self) -> Iterator[None]:
        if self._depth:  # already inside: nested regions share the stream
            yield
            return
        outside = _get_states()
        if self._states[1] is None and outside[1] is not None:
            self._states = (self._states[0], self._seeded_cuda_states(outside[1]))
        _set_states(self._states)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._states = _get_states()
            _set_states(outside)

    def _seeded_cuda_states(self, current: list[Tensor]) -> list[Tensor]:
        """CUDA was initialised after construction: seed its per-rank stream now."""
        torch.cuda.manual_seed_all(self.seed)
        seeded = torch.cuda.get_rng_state_all()
        torch.cuda.set_rng_state_all(current)
        return seeded


def _get_states() -> tuple[Tensor, list[Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_states(states: tuple[Tensor, list[Tensor] | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class ForkedRNG(nn.Module):
    """Runs the wrapped module (a dropout) under a ``TensorParallelRNG`` stream."""

    def __init__(self, module: nn.Module, rng: TensorParallelRNG) -> None:
        super().__init__()
        self.module = module
        self.rng = rng

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.rng.fork():
            return self.module(*args, **kwargs)


def forked(fn: Callable[..., Any], rng: TensorParallelRNG) -> Callable[..., Any]:
    """``fn`` run under ``rng``'s stream (for functional dropout such as attention's)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with rng.fork():
            return fn(*args, **kwargs)

    return run
