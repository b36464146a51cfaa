"""Flat buffers: many tensors seen as one contiguous 1-D tensor, for one collective instead of many.

Every gradient reduction in this package (data-parallel averaging, bucketed all-reduce, ZeRO's
reduce-scatter, the parameter server's push) wants the same thing: a list of tensors packed into
one buffer, a collective on it, and the result copied back. ``FlatBuffer`` is that, once:

* the buffer's dtype and device are those of the tensors it packs (never a hard-coded device), so
  the same code runs on gloo with CPU tensors and on NCCL with CUDA tensors;
* ``pad_to`` rounds the length up to a multiple (a reduce-scatter over ``n`` ranks needs ``n``
  equal shards); the padding is zeros and never copied back;
* ``views`` are the per-tensor slices, shaped like the tensors, so a parameter's ``.data`` or
  ``.grad`` can *be* a view (no copy at all) where the caller wants that;
* ``free`` / ``allocate`` release and re-create the storage while the views stay valid objects
  (ZeRO-3 keeps a block's full parameters only while the block runs: the parameters *are* views,
  so freeing the storage frees them without touching the module);
* ``segments`` says which tensors (and which of their elements) fall in a range of the buffer,
  e.g. in one rank's shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class FlatBuffer:
    """One 1-D buffer with a shaped view per tensor of ``like`` (same order, same shapes).

    ``like``: the tensors whose shapes (and, unless given, dtype and device) the buffer takes.
    ``pad_to``: the buffer's length is rounded up to a multiple of it (zeros at the end).
    """

    def __init__(
        self,
        like: Sequence[Tensor],
        pad_to: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not like:
            raise ValueError("FlatBuffer needs at least one tensor to lay out")
        if pad_to < 1:
            raise ValueError(f"pad_to must be a positive integer, got {pad_to}")
        self.shapes = [t.shape for t in like]
        self.numels = [t.numel() for t in like]
        self.numel = sum(self.numels)  # without padding
        padded = -(-self.numel // pad_to) * pad_to
        self.data = torch.zeros(
            padded,
            dtype=dtype or like[0].dtype,
            device=like[0].device if device is None else device,
        )
        self.views: list[Tensor] = []
        offset = 0
        for shape, n in zip(self.shapes, self.numels):
            self.views.append(self.data[offset : offset + n].view(shape))
            offset += n
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self._padded = padded

    def bounds(self, index: int, count: int) -> tuple[int, int]:
        """``[start, end)`` of shard ``index`` of ``count`` in the (padded) buffer."""
        padded = self._padded
        if padded % count:
            raise ValueError(
                f"a buffer of {padded} elements cannot be cut into {count} equal "
                f"shards; build it with pad_to={count}"
            )
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} is outside [0, {count})")
        size = padded // count
        return index * size, (index + 1) * size

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The tensors overlapping ``[start, end)`` of the buffer, as ``(i, lo, hi)``: elements
        ``lo:hi`` of tensor ``i`` (flattened) lie there. Padding belongs to no tensor."""
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out.append((i, lo - offset, hi - offset))
        return out

    # ------------------------------------------------------------------ storage lifetime
    @property
    def allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0 or self._padded == 0

    def free(self) -> None:
        """Release the storage; ``data`` and ``views`` keep their shapes but hold nothing until
        ``allocate``. Never read them in between."""
        self.data.untyped_storage().resize_(0)

    def allocate(self) -> Tensor:
        """Re-create the storage freed by ``free`` (contents undefined); returns ``data``."""
        nbytes = self._padded * self.data.element_size()
        storage = self.data.untyped_storage()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.data

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        """Copy ``tensors`` into the buffer; returns ``self.data``."""
        for view, t in zip(self.views, tensors, strict=True):
            view.copy_(t)
        return self.data

    def unpack_into(self, tensors: Sequence[Tensor]) -> None:
        """Copy the buffer back into ``tensors`` (padding is dropped)."""
        for view, t in zip(self.views, tensors, strict=True):
            t.copy_(view)

    def shard(self, index: int, count: int) -> Tensor:
        """Shard ``index`` of ``count`` equal, contiguous shards (``pad_to`` must allow it)."""
        start, end = self.bounds(index, count)
        return self.data[start:end]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer when allocated (padding included)."""
        return self._padded * self.data.element_size()


def all_reduce_mean_(
    tensors: Sequence[Tensor], group: dist.ProcessGroup | None, size: int | None = None
) -> int:
    """Average ``tensors`` over ``group`` in place with one flat all-reduce; returns the bytes
    reduced. The tensors (their order and shapes) must be the same on every rank."""
    n = dist.get_world_size(group) if size is None else size
    if n == 1 or not tensors:
        return 0
    buffer = FlatBuffer(tensors)
    dist.all_reduce(buffer.pack(tensors), group=group)
    buffer.data.div_(n)
    buffer.unpack_into(tensors)
    return buffer.nbytes
