"""What a ZeRO engine's model state costs one rank, in bytes, now and at its peak.

``memory_stats`` is what a strategy logs each step (``memory/*_bytes``):

* params: the compute parameters this rank keeps (full at stages 0-2, the shard at 3);
* grads: gradient buffers kept across steps (full at 0-1, plus the shard at 1-3);
* optim: optimizer state plus separate fp32 master shards (mixed precision);
* peak: the most model-state bytes held at once, counting ZeRO-3's gathered units and reductions
  in flight (activations are not model state and are not counted). The engine reports every
  allocation and release as it happens (:meth:`ZeroMemory.track`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.optim import Optimizer

from llmlab.parallel.data.zero_layout import Unit


class ZeroMemory:
    """The model-state bytes of ``units`` at ZeRO ``stage`` and of ``optimizers``' state."""

    def __init__(self, units: Sequence[Unit], stage: int) -> None:
        self.units = list(units)
        self.stage = stage
        self.optimizers: list[Optimizer] = []
        self.optim_bytes = 0  # optimizer state, re-measured after each step
        self.live = self.peak_bytes = 0
        stats = self.stats()
        # model-state bytes besides optimizer state, right now (for the peak)
        self.live = int(stats["memory/params_bytes"] + stats["memory/grads_bytes"])
        self.live += self.masters_bytes()
        self.peak_bytes = self.live

    def track(self, delta: int) -> None:
        """``delta`` bytes were just allocated (or, negative, released)."""
        self.live += delta
        self.peak_bytes = max(self.peak_bytes, self.live + self.optim_bytes)

    def masters_bytes(self) -> int:
        return sum(u.master.nbytes for u in self.units if u.master is not u.shard)

    def measure_optimizer(self) -> None:
        """Re-measure the optimizer state's bytes (after a step, or after loading it)."""
        seen: set[int] = set()
        total = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, Tensor) and v.data_ptr() not in seen:
                        seen.add(v.data_ptr())
                        total += v.numel() * v.element_size()
        self.optim_bytes = total
        self.track(0)

    def stats(self) -> dict[str, float]:
        """``memory/{params,grads,optim,peak}_bytes`` (see the module docstring)."""
        params = sum(u.shard.nbytes if self.stage >= 3 else u.full.nbytes for u in self.units)
        grads = sum(
            (u.grads.nbytes if u.grads is not None else 0)
            + (u.grad_shard.nbytes if u.grad_shard is not None else 0)
            for u in self.units
        )
        self.measure_optimizer()
        return {
            "memory/params_bytes": float(params),
            "memory/grads_bytes": float(grads),
            "memory/optim_bytes": float(self.optim_bytes + self.masters_bytes()),
            "memory/peak_bytes": float(self.peak_bytes),
        }

    def padding_elements(self) -> int:
        """Zeros added so every unit splits into equal shards (at most ``n - 1`` per unit)."""
        return sum(u.full.data.numel() - u.full.numel for u in self.units)
