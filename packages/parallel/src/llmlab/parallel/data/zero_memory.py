"""What a rank's model state costs, in bytes, now and at its peak, at every ZeRO stage.

``memory_stats`` is what a strategy logs each step (``memory/*_bytes``): a ZeRO engine's
(:class:`ZeroMemory`, FSDP2's engine) or, at ``zero=0``, :class:`ReplicatedMemory`'s, so that
``zero=0`` and ``zero>=1`` runs compare key by key:

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
from llmlab.parallel.norm import local_tensor


def optimizer_state_bytes(optimizers: Sequence[Optimizer]) -> int:
    """The bytes of the distinct tensors in ``optimizers``' state (a DTensor by its local shard)."""
    seen: set[int] = set()
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, Tensor):
                    local = local_tensor(v)
                    if local.data_ptr() not in seen:
                        seen.add(local.data_ptr())
                        total += local.numel() * local.element_size()
    return total


def model_state_stats(params: int, grads: int, optim: int, peak: int) -> dict[str, float]:
    """The ``memory/*_bytes`` keys every engine logs (see the module docstring)."""
    return {
        "memory/params_bytes": float(params),
        "memory/grads_bytes": float(grads),
        "memory/optim_bytes": float(optim),
        "memory/peak_bytes": float(peak),
    }


class ReplicatedMemory:
    """``zero=0``: this rank keeps all of its tensor/pipeline share, unsharded over data -- the
    parameters, their gradients, the optimizer state and a precision plugin's fp32 masters (with
    their gradients). All of it lives across steps, so the peak is the largest sum seen."""

    def __init__(
        self,
        params: Sequence[Tensor],
        optimizers: Sequence[Optimizer],
        masters: Sequence[Tensor] = (),
    ) -> None:
        self.params = list(params)
        self.optimizers = list(optimizers)
        self.masters = list(masters)
        self.peak_bytes = 0

    def memory_stats(self) -> dict[str, float]:
        params = sum(p.nbytes for p in self.params)
        grads = sum(t.grad.nbytes for t in [*self.params, *self.masters] if t.grad is not None)
        optim = optimizer_state_bytes(self.optimizers) + sum(m.nbytes for m in self.masters)
        self.peak_bytes = max(self.peak_bytes, params + grads + optim)
        return model_state_stats(params, grads, optim, self.peak_bytes)


class ZeroMemory:
    """The model-state bytes of ``units`` at ZeRO ``stage`` and of ``optimizers``' state."""

    def __init__(self, units: Sequence[Unit], stage: int, kept: Sequence[Tensor] = ()) -> None:
        self.units = list(units)
        self.stage = stage
        self.kept = list(kept)  # parameters the engine leaves whole (expert slices): full size
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
        self.optim_bytes = optimizer_state_bytes(self.optimizers)
        self.track(0)

    def stats(self) -> dict[str, float]:
        """``memory/{params,grads,optim,peak}_bytes`` (see the module docstring)."""
        params = sum(u.shard.nbytes if self.stage >= 3 else u.full.nbytes for u in self.units)
        params += sum(p.nbytes for p in self.kept)
        grads = sum(
            (u.grads.nbytes if u.grads is not None else 0)
            + (u.grad_shard.nbytes if u.grad_shard is not None else 0)
            for u in self.units
        )
        grads += sum(p.grad.nbytes for p in self.kept if p.grad is not None)
        self.measure_optimizer()
        optim = self.optim_bytes + self.masters_bytes()
        return model_state_stats(params, grads, optim, self.peak_bytes)

    def padding_elements(self) -> int:
        """Zeros added so every unit splits into equal shards (at most ``n - 1`` per unit)."""
        return sum(u.full.data.numel() - u.full.numel for u in self.units)
