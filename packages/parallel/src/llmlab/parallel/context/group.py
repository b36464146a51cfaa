"""``ContextParallel``: one context-parallel group as a model and a training step use it.

It bundles what every piece needs: the process group, the split (:class:`ContextLayout`), the
ring's transport and its byte counter. The seam into a model is the ``AttentionSwappable``
contract (``swap_attention``, the door recompute attention uses): :meth:`apply` routes every
attention of the model through :meth:`attention`, ring attention over this group, and fills
in this rank's global position ids when a call gives none. A training step then feeds each
rank its part of the batch::

    cp = ContextParallel(group)                 # zigzag split by default
    cp.apply(model)                             # every attention becomes ring attention
    ids, targets = cp.shard(ids), cp.shard(targets)
    logits = model(ids)                         # positions default to cp.positions(T): global
    cp.loss_share(logits, targets).backward()   # shares sum to the whole sequence's mean
    cp.reduce_gradients(model)                  # replicated parameters: SUM over the group
    cp.stats.bytes_sent                         # == cp_bytes(...) per step (accounting.py)
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.comm import CommStats
from llmlab.parallel.context.blocks import BACKENDS
from llmlab.parallel.context.layout import ContextLayout
from llmlab.parallel.context.loss import reduce_context_gradients, sequence_loss_share
from llmlab.parallel.context.ring import RingTransport, ring_attention
from llmlab.parallel.contracts import AttentionSwappable, require


class ContextParallel:
    """This rank's view of a context-parallel group (``group=None``: the default group).

    ``scheme``: ``"zigzag"`` (balanced, the default) or ``"contiguous"``; ``backend``: the
    block kernels (``"auto"``, ``"flash"``, ``"blocked"``, see ``blocks.py``); ``overlap``:
    post each transfer before the compute it should hide behind (``False`` serialises them,
    to measure the difference).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        scheme: str = "zigzag",
        backend: str = "auto",
        overlap: bool = True,
        stats: CommStats | None = None,
    ) -> None:
        if backend not in BACKENDS:  # the device is checked per call, against the tensors
            raise ValueError(f"unknown ring-attention backend {backend!r}; valid: {list(BACKENDS)}")
        self.group = group
        self.transport = RingTransport(group, stats)
        self.stats = self.transport.stats
        self.rank, self.degree = self.transport.rank, self.transport.size
        self.layout = ContextLayout(self.degree, scheme)
        self.backend = backend
        self.overlap = overlap
        self.active = True  # ring attention on; off: the model computes as if unsplit

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0
    ) -> Tensor:
        """Ring attention with the models' attention signature (``Ops.attention``)."""
        if dropout_p > 0.0:
            raise ValueError(
                f"ring attention has no attention dropout (got dropout_p={dropout_p}); train with "
                "dropout=0.0 or without context parallelism"
            )
        return ring_attention(
            q, k, v, self.transport, self.layout, causal, self.backend, self.overlap
        )

    def apply(self, model: nn.Module, active: bool = True) -> int:
        """Make ``model`` context-parallel, in place; returns how many attention modules changed.

        Every attention goes through :meth:`attention` (the model's ``swap_attention``), and a
        forward pre-hook gives a call without position ids this rank's global ones, so a task
        that calls ``model(ids)`` on its chunk needs no change. The hook refuses an attention
        context (a KV cache) or an attention mask: the models answer those (decoding, padding)
        through the context, over the local keys, which would silently see only this rank's
        chunk. The model must take ``forward(input_ids, positions=None, attention=None,
        attention_mask=None)`` (the one forward GPT and Llama have).

        ``active=False`` keeps the model plain (its own attention, no hook) outside
        :meth:`split`: the N-D strategy splits only its training and validation steps, so a
        callback that samples, or decoding after training, runs the whole sequence on one rank.
        """
        swap = require(model, AttentionSwappable, "context parallelism").swap_attention
        changed = swap(lambda plain: partial(self._route, plain))
        if changed == 0:
            raise ValueError(f"context parallelism: {type(model).__name__}.swap_attention "
                             "changed no module")  # fmt: skip
        model.register_forward_pre_hook(self._global_positions, with_kwargs=True)
        self.active = active
        return changed

    @contextmanager
    def split(self) -> Generator[None, None, None]:
        """Ring attention (and global positions) inside, whatever :attr:`active` was."""
        was, self.active = self.active, True
        try:
            yield
        finally:
            self.active = was

    def _route(self, plain: Callable[..., Tensor], *args: object, **kwargs: object) -> Tensor:
        return (self.attention if self.active else plain)(*args, **kwargs)

    def _global_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.active:
            return args, kwargs
        given = dict(zip(("input_ids", "positions", "attention", "attention_mask"), args)) | kwargs
        if given.get("document_ids") is not None:
            raise ValueError(
                f"a context-parallel {type(module).__name__} cannot mask packed documents "
                "(document_ids=): ring attention passes key chunks between ranks without their "
                "documents; train with data.document_mask=false or without context parallelism"
            )
        for name in ("attention", "attention_mask"):
            if given.get(name) is not None:
                raise ValueError(
                    f"a context-parallel {type(module).__name__} runs whole training sequences "
                    f"only; got {name}= (decoding and padded batches see one rank's chunk of "
                    "keys): decode or evaluate with the unsplit model"
                )
        if given.get("positions") is None:
            ids = given["input_ids"]
            positions = self.positions(ids.shape[1] * self.degree, ids.device)
            if len(args) > 1:
                args = (args[0], positions, *args[2:])
            else:
                kwargs = {**kwargs, "positions": positions}
        return args, kwargs

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x`` (ids, targets, position ids) along ``dim``."""
        return self.layout.shard(x, self.rank, dim)

    def positions(self, seq_len: int, device: torch.device | None = None) -> Tensor:
        """(1, seq_len/N) global position ids of this rank's tokens (``seq_len``: the whole)."""
        return self.layout.positions(self.rank, seq_len, device)

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's ``x`` (not differentiable: for logs, eval)."""
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        dist.all_gather(parts, x.detach().contiguous(), group=self.group)
        return self.layout.unshard(parts, dim)

    def loss_share(
        self, logits: Tensor, targets: Tensor, ignore_index: int = -100, scale: float = 1.0
    ) -> Tensor:
        """:func:`~llmlab.parallel.context.loss.sequence_loss_share` over this group."""
        return sequence_loss_share(logits, targets, self.group, ignore_index, scale)

    def reduce_gradients(self, parameters: nn.Module, op: str = "sum") -> int:
        """:func:`~llmlab.parallel.context.loss.reduce_context_gradients` over this group."""
        return reduce_context_gradients(parameters, self.group, op)
