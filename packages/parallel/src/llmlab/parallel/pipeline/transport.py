"""Point-to-point messages between pipeline stages: tags, shape headers, posted receives.

Everything a pipeline puts on the wire goes through :class:`Transport`, which owns three things
the schedule itself should not care about:

* **Tags.** A message is an activation, a gradient, or the shape header of an activation
  (:class:`Tag`). Its tag also carries the virtual stage that receives it and the micro-batch, so
  on gloo a receive can only match its own send. NCCL ignores tags and matches by order, which
  our schedules keep consistent.
* **Shape headers.** A receiver must allocate a buffer before the data arrives. Activations
  announce their dtype and shape once per (boundary, batch signature) in a fixed-size header
  (:func:`encode_header`); gradients have the shape of the output they belong to, which the
  receiver already knows.
* **Posted receives.** gloo's TCP transport is a rendezvous (a payload leaves only once the
  receiver has posted the matching receive), so the engine may post receives ahead of need
  (:meth:`Transport.post`) and take them later (:meth:`Transport.take`).

Messages between two chunks of the same rank (interleaved schedule) go through a local mailbox.
``bytes_sent`` counts activation and gradient payloads (headers are control, not data).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
HEADER_LEN = 10  # [dtype code, ndim, *shape] padded: tensors of up to 8 dimensions


class Tag(enum.IntEnum):
    ACTIVATION = 0
    GRADIENT = 1
    HEADER = 2


def encode_header(t: Tensor, device: torch.device | str) -> Tensor:
    """A fixed-size int64 tensor describing ``t``'s dtype and shape."""
    if t.dim() > HEADER_LEN - 2:
        raise ValueError(f"a shape header holds at most {HEADER_LEN - 2} dims, got {t.dim()}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0], header[1] = DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape)
    return header


def decode_header(header: Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim = int(header[1])
    return torch.Size(header[2 : 2 + ndim].tolist()), DTYPES[int(header[0])]


def broadcast_tensor(
    t: Tensor | None, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """``src``'s tensor on every rank of ``group`` (the others pass None): header, then data."""
    if t is not None:
        header = encode_header(t, device)
    else:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    shape, dtype = decode_header(header)
    buf = t.contiguous() if t is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src, group=group)
    return buf


class Transport:
    """This stage's sends and receives within one pipeline (``ranks``: global rank per stage)."""

    def __init__(
        self,
        stage: int,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.stage = stage
        self.ranks = list(ranks)
        self.group = group
        self.device = device
        self.bytes_sent = 0
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}  # kept across steps
        self.begin_step(1, 1, ())

    def begin_step(self, num_virtual: int, num_microbatches: int, signature: Any) -> None:
        """Reset the per-step state; ``signature`` keys the activation-shape cache."""
        self._num_virtual = num_virtual
        self._m = num_microbatches
        self._signature = signature
        self._pending: list[tuple[Any, Tensor]] = []
        self._mailbox: dict[int, Tensor] = {}
        self._posted: dict[tuple, tuple[Any, Tensor]] = {}
        self._headers: dict[tuple, tuple[Any, Tensor]] = {}

    def end_step(self) -> None:
        """Wait for every send; fail if a posted receive was never taken."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        if self._posted or self._headers:
            unused = sorted([*self._posted, *self._headers], key=str)
            raise RuntimeError(f"stage {self.stage}: receives posted but never used: {unused}")

    # ---------------------------------------------------------------------- tags
    def tag(self, kind: Tag, receiving_vs: int, microbatch: int) -> int:
        return (int(kind) * (self._num_virtual + 1) + receiving_vs) * (self._m + 1) + microbatch

    def _boundary(self, receiving_vs: int) -> tuple:
        return (receiving_vs, self._signature)

    # --------------------------------------------------------------------- sends
    def _isend(self, tensor: Tensor, peer: int, tag: int) -> None:
        if peer == self.stage:  # interleaved on one rank: a chunk feeds the next chunk locally
            self._mailbox[tag] = tensor
            return
        work = dist.isend(tensor, self.ranks[peer], group=self.group, tag=tag)
        self._pending.append((work, tensor))

    def send_activation(self, t: Tensor, peer: int, receiving_vs: int, microbatch: int) -> None:
        tensor = t.detach().contiguous()
        boundary = self._boundary(receiving_vs)
        if boundary not in self._shapes:
            # The receiver learns the shape from a header, once; a chunk of this same rank
            # shares this cache and needs none.
            self._shapes[boundary] = (tensor.shape, tensor.dtype)
            if peer != self.stage:
                header = encode_header(tensor, self.device)
                self._isend(header, peer, self.tag(Tag.HEADER, receiving_vs, microbatch))
        self._count(tensor, peer)
        self._isend(tensor, peer, self.tag(Tag.ACTIVATION, receiving_vs, microbatch))

    def send_gradient(self, g: Tensor, peer: int, receiving_vs: int, microbatch: int) -> None:
        tensor = g.contiguous()
        self._count(tensor, peer)
        self._isend(tensor, peer, self.tag(Tag.GRADIENT, receiving_vs, microbatch))

    def _count(self, tensor: Tensor, peer: int) -> None:
        if peer != self.stage:
            self.bytes_sent += tensor.numel() * tensor.element_size()

    # ------------------------------------------------------------------ receives
    def post_header(self, peer: int, receiving_vs: int, microbatch: int) -> None:
        """Post the shape-header receive of a boundary met for the first time this step."""
        boundary = self._boundary(receiving_vs)
        if peer == self.stage or boundary in self._shapes or boundary in self._headers:
            return
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        tag = self.tag(Tag.HEADER, receiving_vs, microbatch)
        work = dist.irecv(header, self.ranks[peer], group=self.group, tag=tag)
        self._headers[boundary] = (work, header)

    def activation_shape(
        self, peer: int, receiving_vs: int, microbatch: int
    ) -> tuple[torch.Size, torch.dtype]:
        """The shape of an incoming activation: cached, or read from its (posted) header."""
        boundary = self._boundary(receiving_vs)
        if boundary not in self._shapes:
            if boundary not in self._headers:
                self.post_header(peer, receiving_vs, microbatch)
            work, header = self._headers.pop(boundary)
            work.wait()
            self._shapes[boundary] = decode_header(header)
        return self._shapes[boundary]

    def known_activation_shape(self, receiving_vs: int) -> tuple[torch.Size, torch.dtype] | None:
        return self._shapes.get(self._boundary(receiving_vs))

    def post(
        self,
        kind: Tag,
        peer: int,
        receiving_vs: int,
        microbatch: int,
        shape: tuple[torch.Size, torch.dtype],
    ) -> None:
        """Post the ``irecv`` of a message now (no-op if already posted or local)."""
        key = (kind, receiving_vs, microbatch)
        if peer == self.stage or key in self._posted:
            return
        buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
        tag = self.tag(kind, receiving_vs, microbatch)
        self._posted[key] = (dist.irecv(buf, self.ranks[peer], group=self.group, tag=tag), buf)

    def take(
        self,
        kind: Tag,
        peer: int,
        receiving_vs: int,
        microbatch: int,
        shape: tuple[torch.Size, torch.dtype],
    ) -> Tensor:
        """The message's data, waited for here (posting its receive first if needed)."""
        if peer == self.stage:
            return self._mailbox.pop(self.tag(kind, receiving_vs, microbatch)).clone()
        key = (kind, receiving_vs, microbatch)
        if key not in self._posted:
            self.post(kind, peer, receiving_vs, microbatch, shape)
        work, buf = self._posted.pop(key)
        work.wait()
        return buf
