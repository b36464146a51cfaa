"""Point-to-point messaging that counts what it sends: the only primitive our collectives use.

Every collective in this package is written against ``Peer`` (send / recv / isend / irecv within a
group, addressed by *group* rank), so the bytes a rank puts on the wire are counted in one place
and can be checked against each algorithm's formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes and messages this rank has sent (receives are the mirror image on the peer)."""

    bytes_sent: int = 0
    messages: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def record(self, op: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes

    def reset(self) -> None:
        self.bytes_sent = 0
        self.messages = 0
        self.by_op.clear()


class Peer:
    """This rank's view of a process group for point-to-point traffic.

    ``rank`` and ``size`` are group-local; ``global_rank(i)`` translates for ``torch.distributed``,
    whose point-to-point calls take global ranks even when a group is given.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        op: str = "p2p",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("llmlab.parallel.comm needs torch.distributed to be initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = stats
        self.op = op
        self._globals = [
            i if group is None else dist.get_global_rank(group, i) for i in range(self.size)
        ]

    def global_rank(self, group_rank: int) -> int:
        return self._globals[group_rank]

    def _count(self, tensor: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.record(self.op, tensor.numel() * tensor.element_size())

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.numel() == 0:
            return  # both sides know the chunk sizes, so empty messages are skipped on both
        self._count(tensor)
        dist.send(tensor.contiguous(), self.global_rank(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        dist.recv(tensor, self.global_rank(src), group=self.group)

    def isend(self, tensor: torch.Tensor, dst: int) -> dist.Work | None:
        if tensor.numel() == 0:
            return None
        self._count(tensor)
        return dist.isend(tensor, self.global_rank(dst), group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int) -> dist.Work | None:
        if tensor.numel() == 0:
            return None
        return dist.irecv(tensor, self.global_rank(src), group=self.group)

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to ``dst`` while receiving from ``src``: both posted before either waits, so a ring
        or a pairwise swap cannot deadlock whatever the message size."""
        works = [self.isend(send.contiguous(), dst), self.irecv(recv, src)]
        for work in works:
            if work is not None:
                work.wait()
