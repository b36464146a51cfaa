"""A rank's pieces of a tensor, described in the *unsharded* tensor's coordinates.

ZeRO cuts a flat buffer into equal contiguous ranges, so a rank owns elements ``lo:hi`` of a
parameter's row-major flattening -- usually not a rectangle of the parameter. A checkpoint that
other layouts can read needs rectangles in the global tensor (``torch.distributed.checkpoint``
stores chunks as offsets + sizes), so :func:`flat_boxes` splits a flat range into the few boxes
it is made of (at most ``2·ndim - 1``: a partial row, whole rows, a partial row, recursively).

:class:`ShardedView` hands those boxes to DCP: a tensor wrapper of the *global* shape that holds
only this rank's boxes, each a view into live storage, so saving reads the parameters and
optimizer state in place and loading writes straight into them. It implements DCP's
``_Checkpointable`` hooks (the same three ``DTensor`` implements), nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Elements ``lo:hi`` of a row-major tensor of ``shape`` as boxes, in flat order.

    Concatenating the boxes' elements (each box row-major) gives exactly ``lo:hi``.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"range {lo}:{hi} is outside a tensor of {total} elements {shape}")
    if lo == hi:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)

    def row(r: int, a: int, b: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out: list[Box] = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


class ShardedView(Tensor):
    """This rank's boxes of a tensor of ``global_shape``, for ``torch.distributed.checkpoint``.

    Build it with :meth:`from_flat` (a ZeRO piece) or directly from ``(offsets, tensor)`` pairs.
    Only DCP should touch it; any other op raises.
    """

    _boxes: list[tuple[tuple[int, ...], Tensor]]

    @staticmethod
    def __new__(
        cls, global_shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Tensor]]
    ) -> ShardedView:
        if not boxes:
            raise ValueError("a ShardedView needs at least one box; leave the key out instead")
        like = boxes[0][1]
        for offsets, t in boxes:
            if len(offsets) != len(global_shape) or t.dim() != len(global_shape):
                raise ValueError(
                    f"box of shape {tuple(t.shape)} at {tuple(offsets)} does not fit a tensor of "
                    f"shape {tuple(global_shape)}"
                )
            if any(o + s > g for o, s, g in zip(offsets, t.shape, global_shape)):
                raise ValueError(
                    f"box of shape {tuple(t.shape)} at {tuple(offsets)} runs past the global "
                    f"shape {tuple(global_shape)}"
                )
        r = Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=like.dtype, device=like.device
        )
        r._boxes = [(tuple(int(o) for o in offsets), t) for offsets, t in boxes]
        return r

    @classmethod
    def from_flat(
        cls,
        flat: Tensor,
        shape: Sequence[int],
        lo: int,
        offset: Sequence[int] | None = None,
        global_shape: Sequence[int] | None = None,
    ) -> ShardedView:
        """``flat`` holds elements ``lo:lo+len(flat)`` of a local tensor of ``shape``; that local
        tensor sits at ``offset`` of a global one (tensor parallelism) -- by default it *is* the
        global tensor."""
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        global_shape = tuple(global_shape) if global_shape is not None else tuple(shape)
        boxes, cursor = [], 0
        for offs, sizes in flat_boxes(shape, lo, lo + flat.numel()):
            n = math.prod(sizes)
            view = flat[cursor : cursor + n].view(sizes)
            boxes.append((tuple(a + b for a, b in zip(offs, offset)), view))
            cursor += n
        return cls(global_shape, boxes)

    @property
    def boxes(self) -> list[tuple[tuple[int, ...], Tensor]]:
        return self._boxes

    # ------------------------------------------------------------------ DCP's _Checkpointable
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                    properties=props,
                    size=self.shape,
                ),
            )
            for offsets, t in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        if index.index is not None and index.index < len(self._boxes):
            offsets, t = self._boxes[index.index]
            if torch.Size(offsets) == index.offset:
                return t
        for offsets, t in self._boxes:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no box at {index.offset}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"ShardedView only serves checkpointing; {func} is not supported")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedView(shape={tuple(self.shape)}, boxes={[o for o, _ in self._boxes]})"
