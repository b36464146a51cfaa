"""ZeRO-3's gathering: a unit's full parameters exist only while it computes.

Each unit keeps only this rank's shard between uses. Just before a unit's forward its parameters
are all-gathered into the unit's flat buffer, and again before its backward (hooked on the
gradients of its outputs); after use the buffer is freed. The order units ran in the previous
step is the prefetch plan: while unit ``i`` computes, the gather of the next unit is in flight,
so at most two units are gathered at once (activation checkpointing's recomputation, inside
backward, gathers what it needs). The hooks sit on the units' modules -- the repeated blocks and
the largest subtrees holding the rest (:func:`~llmlab.parallel.data.zero_layout.stage3_segments`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from llmlab.parallel.data.zero_layout import (
    REST,
    Unit,
    all_gather_into,
    check_stage3_sharing,
    stage3_segments,
)


class Stage3Gatherer:
    """Gathers and frees ``units`` of ``module`` around their use, over the engine's group.

    ``track(delta)``: the engine's memory meter (bytes held, for the peak); ``begin_backward()``:
    tells the engine a backward pass has started (it queues its end-of-backward callback);
    ``in_backward()``: whether one is running (recomputation gathers on demand then).
    """

    def __init__(
        self,
        module: nn.Module,
        blocks: Sequence[nn.Module],
        units: Sequence[Unit],
        group: Any,
        world: int,
        prefetch: bool,
        track: Callable[[int], None],
        begin_backward: Callable[[], None],
        in_backward: Callable[[], bool],
    ) -> None:
        self.units = list(units)
        self.group = group
        self.world = world
        self.prefetch = prefetch
        self.comm_bytes = 0
        self._track = track
        self._begin_backward = begin_backward
        self._in_backward = in_backward
        self._events: list[int] = []  # units in the order this step used them
        self._plan: list[int] | None = None  # ... and in the previous step (prefetch order)
        self.handles: list[RemovableHandle] = []
        users: dict[int, list[nn.Module]] = {}
        by_name = {u.name: u for u in self.units}
        for b, block in enumerate(blocks):
            if f"block{b}" in by_name:
                users[by_name[f"block{b}"].index] = [block]
        if REST in by_name:
            rest = by_name[REST]
            users[rest.index] = stage3_segments(module, blocks, {id(p) for p in rest.params})
        check_stage3_sharing(self.units, users)
        for index, modules in users.items():
            for m in modules:
                self.handles.append(
                    m.register_forward_pre_hook(lambda *_, i=index: self._pre_forward(i))
                )
                self.handles.append(
                    m.register_forward_hook(lambda _m, _a, out, i=index: self._post_forward(i, out))
                )
        self.handles.append(module.register_forward_pre_hook(self._root_pre_forward))
        self.handles.append(module.register_forward_hook(self._root_post_forward))

    # ------------------------------------------------------------------ gather / free
    def ensure_gathered(self, u: Unit) -> None:
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
        elif not u.gathered:
            self.start_gather(u)
            if u.gather_work is not None:
                u.gather_work.wait()
                u.gather_work = None

    def start_gather(self, u: Unit) -> None:
        u.full.allocate()
        self._track(u.full.nbytes)
        if self.world > 1:
            self.comm_bytes += u.full.nbytes
            u.gather_work = all_gather_into(u.full.data, u.shard, group=self.group, async_op=True)
        else:
            u.full.data.copy_(u.shard)

    def free(self, u: Unit) -> None:
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
        if u.gathered:
            u.full.free()
            self._track(-u.full.nbytes)

    def free_all(self) -> None:
        for u in self.units:
            if u.gathered or u.gather_work is not None:
                self.free(u)

    def end_backward(self) -> None:
        """Free what the backward left gathered; this step's order plans the next one's."""
        self.free_all()
        self._plan, self._events = self._events, []

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's full parameters present (to evaluate or export); freed after."""
        for u in self.units:
            self.ensure_gathered(u)
        try:
            yield
        finally:
            for u in self.units:
                self.free(u)

    def close(self) -> None:
        """Gather every unit for good and remove the hooks: the module is a plain one again."""
        for u in self.units:
            self.ensure_gathered(u)
        for h in self.handles:
            h.remove()
        self.handles = []

    # ------------------------------------------------------------------ the hooks
    def _root_pre_forward(self, *_: Any) -> None:
        if not self._in_backward():
            self._events = []

    def _root_post_forward(self, *_: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will come to free them
            self.free_all()
            self._events = []

    def _pre_forward(self, index: int) -> None:
        if self._in_backward():  # recomputation (activation checkpointing) inside backward
            self.ensure_gathered(self.units[index])
        else:
            self._event(index)

    def _post_forward(self, index: int, output: Any) -> None:
        if self._in_backward() or not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        fired = [False]

        def pre_backward(grad: Tensor) -> None:
            if not fired[0]:  # once per use, whichever output's gradient arrives first
                fired[0] = True
                self._begin_backward()
                self._event(index)

        for t in tensors:
            t.register_hook(pre_backward)

    def _event(self, index: int) -> None:
        """Unit ``index`` is about to run: keep it and the next one gathered, free the rest."""
        pos = len(self._events)
        self._events.append(index)
        nxt = None
        plan = self._plan
        if self.prefetch and plan is not None and pos < len(plan) and plan[pos] == index:
            nxt = next((j for j in plan[pos + 1 :] if j != index), None)
        for u in self.units:
            if u.index not in (index, nxt) and (u.gathered or u.gather_work is not None):
                self.free(u)
        self.ensure_gathered(self.units[index])
        if nxt is not None and not self.units[nxt].gathered:
            self.start_gather(self.units[nxt])
