"""Activation checkpointing that recomputes once for a split backward (B and W share it).

``torch.utils.checkpoint`` (non-reentrant) keeps the tensors it recomputes per autograd *graph
task*: every ``backward``/``autograd.grad`` call that unpacks a checkpointed block's saved tensors
recomputes the block's forward for itself. A split backward calls autograd once for B and once
per weight group for W, so a checkpointed transformer block would be recomputed up to a dozen
times per micro-batch (measured on the tiny GPT: 1 + 6 forwards per block).

:func:`checkpoint_shared` keeps the same idea -- during the forward, autograd saves a small slot
instead of each tensor; the first unpack re-runs the block with the forward's RNG state, autocast
and default dtype and fills every slot -- but the recomputed tensors belong to the *call*, not to
one graph task. Each one lives exactly as long as the slot autograd holds for it: B's unpacks and
W's later unpacks read the same recomputed tensors, and a tensor is freed when the graph node that
saved it is (after B for the input-path-only nodes, after W for the rest). One recompute per
micro-batch and block, whatever the schedule.

:func:`share_recompute` switches the blocks that ``apply_activation_checkpointing`` wrapped with
PyTorch's ``checkpoint_wrapper`` over to it (names and state-dict keys unchanged).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn


class _Call:
    """One checkpointed call: how to run it again, and its recomputed saved tensors."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng: bool):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.live: set[int] = set()  # slots autograd still holds
        self.saved: dict[int, Tensor] | None = None
        self.packed = 0  # tensors the forward saved
        self.default_dtype = torch.get_default_dtype()
        self.autocast = {
            dev: (torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
            for dev in ("cpu", "cuda")
            if torch.amp.is_autocast_available(dev)
        }
        tensors = [a for a in args if isinstance(a, Tensor)]
        self.cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.rng = None
        if preserve_rng:
            cuda = [torch.cuda.get_rng_state(d) for d in self.cuda]
            self.rng = (torch.get_rng_state(), cuda)

    def pack(self, index: int) -> _Slot:
        self.live.add(index)
        return _Slot(self, index)

    def tensor(self, index: int) -> Tensor:
        if self.saved is None:
            self.saved = self._recompute()
        return self.saved[index]

    def release(self, index: int) -> None:
        self.live.discard(index)
        if self.saved is not None:
            self.saved.pop(index, None)

    def _recompute(self) -> dict[int, Tensor]:
        saved: dict[int, Tensor] = {}
        counter = itertools.count()

        def keep(t: Tensor) -> None:
            index = next(counter)
            if index in self.live:
                saved[index] = t

        def never(_: None) -> Tensor:
            raise RuntimeError("a recomputed graph is never differentiated")

        args = tuple(
            a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
            for a in self.args
        )
        default = torch.get_default_dtype()
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.cuda, enabled=bool(self.rng)))
            if self.rng is not None:
                torch.set_rng_state(self.rng[0])
                for device, state in zip(self.cuda, self.rng[1], strict=True):
                    torch.cuda.set_rng_state(state, device)
            for dev, (dtype, enabled) in self.autocast.items():
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, never))
            torch.set_default_dtype(self.default_dtype)
            try:
                self.fn(*args, **self.kwargs)
            finally:
                torch.set_default_dtype(default)
        if next(counter) != self.packed:
            raise RuntimeError(
                f"recomputing {getattr(self.fn, '__name__', self.fn)!r} saved a different "
                f"number of tensors than its forward ({self.packed}); a checkpointed block must "
                "run the same operations every time it is called"
            )
        return saved


class _Slot:
    """What autograd saves instead of a tensor; frees the recomputed tensor when it dies."""

    __slots__ = ("call", "index")

    def __init__(self, call: _Call, index: int) -> None:
        self.call, self.index = call, index

    def __del__(self) -> None:
        self.call.release(self.index)


def checkpoint_shared(
    fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` saving nothing for backward; recomputed once, at the first
    unpack of any backward, and shared by every later one (B and W)."""
    call = _Call(fn, args, kwargs, preserve_rng_state)
    counter = itertools.count()

    def pack(_: Tensor) -> _Slot:
        return call.pack(next(counter))

    def unpack(slot: _Slot) -> Tensor:
        return slot.call.tensor(slot.index)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    call.packed = next(counter)
    return out


def share_recompute(module: nn.Module) -> int:
    """Re-wrap every ``checkpoint_wrapper``-wrapped block inside ``module`` so that it
    recomputes with :func:`checkpoint_shared`; returns how many blocks it switched.

    Each wrapper is replaced in its parent by a new ``checkpoint_wrapper`` around the same block
    (``checkpoint_fn`` is a constructor argument: the wrapper itself is not rewired), so
    parameters, names and state-dict keys are unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    shared = functools.partial(checkpoint_shared, preserve_rng_state=True)
    switched = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            block = getattr(child, "_checkpoint_wrapped_module", None)
            if block is None or getattr(child.checkpoint_fn, "func", None) is checkpoint_shared:
                continue
            setattr(parent, name, checkpoint_wrapper(block, checkpoint_fn=shared))
            switched += 1
    return switched


def uses_shared_recompute(module: nn.Module) -> bool:
    """Whether every checkpointed block inside ``module`` recomputes with
    :func:`checkpoint_shared` (true when it has none)."""
    return all(
        getattr(getattr(m, "checkpoint_fn", None), "func", None) is checkpoint_shared
        for m in module.modules()
        if hasattr(m, "_checkpoint_wrapped_module")
    )
