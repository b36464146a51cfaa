"""The model runner: the KV pool's tensors, and one forward over a packed batch of chunks.

A step's chunks (sequence, first new position, token count) become one row of ``N`` tokens:
``input_ids`` and ``positions`` (1, N), each token's *slot* in the pool (``slot_mapping``),
each sequence's block table and context length, and the offsets of its queries
(``query_start``). While the forward runs, every attention layer of the model (wrapped once
through the model's ``swap_attention``, see ``llmlab.serving.contracts``) writes its new keys
and values into their slots, then attends through the block tables with
``llmlab.kernels.paged_attention``. Only the rows whose chunk reaches its sequence's end go
through the LM head (``logits_to_keep``).

The pool is one pair of tensors per layer, ``(num_blocks, block_size, H_kv, D)``, zeroed at
start so a masked slot never holds NaN. Its shapes come from a probe: one single-token forward
through the model's own attention records each layer's ``k`` heads, head dim and dtype (the
device is the model's).

**The hot path.** A step that decodes one token of one sequence, on a CPU, is one native call
where the model offers one (``native_decode_step``; ``llmlab.models.GPT``'s and ``Llama``'s are
C++, ``llmlab.models.native``): its whole forward, paged attention through the block table
included, with no tensors prepared here and no Python per layer. Its logits equal the Python
step's to fp32 rounding. Why: on the serving benchmark's GPT-2 (batch 1, one CPU thread) the
Python step's forward took 1.51 ms per token around 0.84 ms of matrix-vector products (~21 MB of
weights read per token), the native one 0.98 ms (SUMMARY.md's serving notes).
Without one, a decode of one sequence whose blocks lie one after another in the pool (a lone
request's, while the pool's free queue is still in order) skips the general machinery: no
``PagedLayout``, the new key and value are written at their slot, and each layer runs the one
SDPA call the reference would run, over a slice of the pool (see ``_PagedLayer``). Models that
offer ``inference_forward`` (``llmlab.models.GPT``: ``forward`` without ``nn.Module``
dispatch, bit-identical) are run through it. Both skip module hooks, so both are used only
while none is registered.
A step of a few decodes (up to ``EACH_MAX_SEQS``, blocks anywhere) also skips the layout: one
SDPA call per sequence over a view of the pool or its keys gathered (``_attend_each``).

On a CPU the runner first stores every linear weight of the model in the memory order that
multiplies one row fastest on this machine (``llmlab.decoding.layout``; CUDA weights are left
alone): a decode step is a chain of one-row products, bound by reading the weights. Products of
two rows or more go through oneDNN on packed copies of the weights (``llmlab.serving.linear``).
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as nn_module

from llmlab.decoding.layout import tune_linear_layouts
from llmlab.kernels.paged_attention import PagedLayout, Scratch, paged_attention
from llmlab.serving.config import EngineConfig
from llmlab.serving.contracts import AttentionFn, check_paged_model
from llmlab.serving.linear import Linears
from llmlab.serving.scheduler import Chunk

# decode-only steps of up to this many sequences attend one sequence at a time (_attend_each);
# measured on the serving benchmark's GPT-2 (4 layers, per step): faster than the general path
# for 1 to 8 decodes of unequal lengths (8 of 50-400 keys: 2.3 ms against 2.6), as fast for 8
# equal ones, slower for 12 equal ones (3.1 ms against 2.6), where one padded call wins
EACH_MAX_SEQS = 8


@dataclass
class PagedBatch:
    """The tensors one forward reads (see the module docstring)."""

    input_ids: Tensor  # (1, N)
    positions: Tensor  # (1, N)
    slot_mapping: Tensor | None  # (N,) pool slot of each new token (None on the hot path)
    layout: PagedLayout | None  # block tables (padded with block 0), query offsets, lengths
    logits_indices: Tensor | int  # rows whose logits are wanted; 0: every row (no gather)
    # the hot path (one decode, consecutive blocks): the new token's slot, the sequence's first
    # slot and its length (see _attend_single)
    single: tuple[int, int, int] | None = None
    # a step of a few decodes (see _attend_each): where each sequence's keys are, as
    # (first slot, length) when its blocks are consecutive, else the slot of every key
    each: list[tuple[int, int] | Tensor] | None = None


class KVPool:
    """Per-layer key and value blocks, shared by every sequence through block tables."""

    def __init__(self, shapes: list[tuple[int, int]], num_blocks: int, block_size: int, dtype,
                 device) -> None:  # fmt: skip
        self.block_size = block_size
        self.keys = [
            torch.zeros(num_blocks, block_size, h, d, dtype=dtype, device=device) for h, d in shapes
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` receives block ``src``'s keys and values, every layer."""
        src = torch.tensor([s for s, _ in copies], device=self.keys[0].device)
        dst = torch.tensor([d for _, d in copies], device=self.keys[0].device)
        for t in (*self.keys, *self.values):
            t.index_copy_(0, dst, t.index_select(0, src))


class _PagedLayer:
    """The attention function of layer ``layer`` while the runner is active."""

    def __init__(self, runner: ModelRunner, layer: int, fallback: AttentionFn) -> None:
        self.runner, self.layer, self.fallback = runner, layer, fallback

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0
    ) -> Tensor:
        runner = self.runner
        batch = runner.batch
        if batch is not None and batch.single is not None:  # the hot path first
            pool = runner.pool
            return _attend_single(q, k, v, pool.keys[self.layer], pool.values[self.layer],
                                  *batch.single)  # fmt: skip
        if batch is not None and batch.each is not None:  # a few decodes, one SDPA each
            pool = runner.pool
            return _attend_each(q, k, v, pool.keys[self.layer], pool.values[self.layer],
                                batch.slot_mapping, batch.each, runner.scratch)  # fmt: skip
        if runner.probe is not None:  # learning the pool's shapes
            runner.probe.append((k.shape[1], k.shape[3], k.dtype))
            return self.fallback(q, k, v, causal=causal, dropout_p=dropout_p)
        if batch is None:  # not the engine's forward: the model's own attention
            return self.fallback(q, k, v, causal=causal, dropout_p=dropout_p)
        keys, values = runner.pool.keys[self.layer], runner.pool.values[self.layer]
        _write_kv(keys, values, batch.slot_mapping, k, v)
        out = paged_attention(q[0].transpose(0, 1), keys, values, batch.layout,
                              backend=runner.backend)  # fmt: skip
        return out.transpose(0, 1)[None]  # (1, H, N, D), as the model's attention returns


def _write_kv(keys: Tensor, values: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Write the step's keys and values, (1, H_kv, N, D), as pool rows at their ``slots`` (N,)."""
    heads, dim = keys.shape[2], keys.shape[3]
    keys.view(-1, heads, dim).index_copy_(0, slots, k[0].transpose(0, 1))
    values.view(-1, heads, dim).index_copy_(0, slots, v[0].transpose(0, 1))


def _pool_span(pool: Tensor, first: int, length: int) -> Tensor:
    """Slots ``first .. first + length - 1`` of a layer's pool (num_blocks, block_size, H_kv, D)
    as (1, H_kv, length, D): the reference's ``pool[...].view(1, -1, H_kv, D).transpose(1, 2)``
    of consecutive blocks, in one op and with the same strides."""
    heads, dim = pool.shape[2], pool.shape[3]
    shape, strides = (1, heads, length, dim), (length * heads * dim, dim, heads * dim, 1)
    return pool.as_strided(shape, strides, pool.storage_offset() + first * heads * dim)


def _attend_single(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slot: int,
                   first: int, length: int) -> Tensor:  # fmt: skip
    """One decode token over consecutive slots ``first .. first + length - 1`` of the pool
    (``slot``, the new token's, is the last): the one SDPA call ``paged_attention``'s reference
    makes for it, on tensors of the same shapes and strides (so the same result, bit for bit),
    without the layout, the checks and the dispatch that a general step needs.

    ``q``/``k``/``v``: (1, H, 1, D) / (1, H_kv, 1, D); ``keys``/``values``: this layer's pool
    (num_blocks, block_size, H_kv, D). Returns (1, H, 1, D) as the model's attention does.
    """
    heads, dim = keys.shape[2], keys.shape[3]
    flat_k, flat_v = keys.view(-1, heads, dim), values.view(-1, heads, dim)
    flat_k[slot].copy_(k.reshape(heads, dim))
    flat_v[slot].copy_(v.reshape(heads, dim))
    kk, vv = _pool_span(keys, first, length), _pool_span(values, first, length)
    return F.scaled_dot_product_attention(q, kk, vv, scale=1.0 / math.sqrt(dim),
                                          enable_gqa=q.shape[1] != heads)  # fmt: skip


def _attend_each(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slots: Tensor,
                 each: list[tuple[int, int] | Tensor], scratch: Scratch) -> Tensor:  # fmt: skip
    """``S`` decode tokens of ``S`` sequences, one SDPA call each over exactly its keys: a view
    of the pool where its blocks are consecutive (as ``_attend_single``), else its keys gathered
    into ``scratch``; no ``PagedLayout``, no padding, no mask.

    Why: for a few decodes of unequal lengths the general path's bookkeeping (layout, length
    groups, padded gathers, masks, scattering rows back) cost more than the attention itself
    (measured on the serving benchmark's GPT-2, 4 layers: 3 decodes of 212, 53 and 182 keys
    1.2 ms per step, 0.5-0.6 ms here). Unmasked calls where the general path masks padded
    groups: the logits agree within fp32 rounding (2e-6 in tests/serving/test_hot_path.py).

    ``q``/``k``/``v``: (1, H, S, D) / (1, H_kv, S, D); ``slots``: (S,) the new tokens' slots.
    Returns (1, H, S, D) as the model's attention does.
    """
    _write_kv(keys, values, slots, k, v)
    heads, dim = keys.shape[2], keys.shape[3]
    flat_k, flat_v = keys.view(-1, heads, dim), values.view(-1, heads, dim)
    scale, gqa = 1.0 / math.sqrt(dim), q.shape[1] != heads
    outs = []
    for i, where in enumerate(each):
        if isinstance(where, tuple):
            kk, vv = _pool_span(keys, *where), _pool_span(values, *where)
        else:
            n = where.numel()
            kk = torch.index_select(flat_k, 0, where, out=scratch.rows("k", n, flat_k))
            vv = torch.index_select(flat_v, 0, where, out=scratch.rows("v", n, flat_v))
            kk, vv = (
                kk.view(1, n, heads, dim).transpose(1, 2),
                vv.view(1, n, heads, dim).transpose(1, 2),
            )
        outs.append(F.scaled_dot_product_attention(q[:, :, i : i + 1], kk, vv, scale=scale,
                                                   enable_gqa=gqa))  # fmt: skip
    return torch.cat(outs, dim=2)


class ModelRunner:
    def __init__(self, model: Any, config: EngineConfig) -> None:
        check_paged_model(model)
        self.model = model
        self.config = config
        # every module's forward-hook dicts (registering or removing a hook mutates them in
        # place), checked before each forward in one C-level pass (see _lean_forward)
        modules = list(model.modules()) if hasattr(model, "modules") else []
        self._hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        # the model's own verdict on whether its lean forward covers all of its layers
        applies = getattr(model, "inference_forward_applies", None)
        self._lean = model.inference_forward if applies is not None and applies() else None
        self.device = next(iter(model.parameters())).device
        # Batch-1 decoding reads every weight once per token: on a CPU the memory order of
        # each weight decides how fast (see llmlab.decoding.layout).
        self.retuned = tune_linear_layouts(model) if config.tune_weight_layouts else []
        # and multiplies through oneDNN on packed copies of the weights where that is faster
        # (llmlab.serving.linear), in the lean forward only: the model's own forward is untouched
        takes = self._lean is not None and "linear" in inspect.signature(self._lean).parameters
        self.linear = Linears(model, enabled=self.device.type == "cpu" and config.onednn_linear
                              and takes)  # fmt: skip
        self.backend = config.attention_backend
        if self.backend == "auto":
            self.backend = "triton" if self.device.type == "cuda" else "torch"
        self.batch: PagedBatch | None = None
        self.scratch = Scratch()  # gather buffers reused by every forward
        self._block_offsets = torch.arange(config.block_size, device=self.device)
        self.probe: list[tuple[int, int, torch.dtype]] | None = None
        self._num_layers = 0
        self.num_layers = model.swap_attention(self._wrap)
        shapes, dtype = self._probe_shapes()
        self.pool = KVPool(shapes, config.num_blocks, config.block_size, dtype, self.device)
        # the hot path's step as one native call where the model offers one (after the layout
        # tuning above: it holds the weight tensors as they are now)
        self.native = NativeStep(self)
        self.native.get()

    def _wrap(self, fn: AttentionFn) -> AttentionFn:
        layer = _PagedLayer(self, self._num_layers, fn)
        self._num_layers += 1
        return layer

    @torch.inference_mode()
    def _probe_shapes(self) -> tuple[list[tuple[int, int]], torch.dtype]:
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.probe = []
        try:
            self.model(one, positions=one, logits_to_keep=one[0])
        finally:
            probe, self.probe = self.probe, None
        if len(probe) != self.num_layers:
            raise TypeError(
                f"{type(self.model).__name__}.swap_attention wrapped {self.num_layers} layers but "
                f"a forward called {len(probe)} of them: llmlab.serving needs every attention "
                f"layer to go through its attention function"
            )
        dtypes = {p[2] for p in probe}
        if len(dtypes) != 1:
            raise TypeError(
                f"attention layers disagree on the KV dtype: {sorted(map(str, dtypes))}"
            )
        return [(h, d) for h, d, _ in probe], dtypes.pop()

    # --------------------------------------------------------------------------- a step
    def prepare(self, chunks: list[Chunk]) -> PagedBatch:
        """The packed tensors of ``chunks`` (see the module docstring)."""
        bs = self.config.block_size
        if self.backend == "torch" and all(c.num_tokens == 1 for c in chunks):  # decodes only
            single = self._prepare_single(chunks[0]) if len(chunks) == 1 else None
            if single is not None:
                return single
            if len(chunks) <= EACH_MAX_SEQS:
                return self._prepare_each(chunks)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        keep: list[int] = []
        for chunk in chunks:
            seq, s = chunk.seq, chunk.start
            e = s + chunk.num_tokens
            table = seq.block_table
            ids += seq.token_ids[s:e]
            positions += range(s, e)
            slots += [table[p // bs] * bs + p % bs for p in range(s, e)]
            starts.append(starts[-1] + chunk.num_tokens)
            lens.append(e)
            if chunk.completes:
                keep.append(starts[-1] - 1)
        width = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in chunks]

        def tensor(values: Any, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return PagedBatch(
            input_ids=tensor([ids]),
            positions=tensor([positions]),
            slot_mapping=tensor(slots),
            layout=PagedLayout(
                tensor(tables, torch.int32),
                tensor(starts, torch.int32),
                tensor(lens, torch.int32),
                bs,
                self.scratch,
            ),
            # decode-only steps want every row: 0 (HF's "all") skips a gather before the head
            logits_indices=0 if len(keep) == starts[-1] else tensor(keep),
        )

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], copies: list[tuple[int, int]] = ()) -> Tensor:
        """Run one forward; float32 logits (K, V) for the chunks that complete their sequence,
        in order."""
        if copies:
            self.pool.copy_blocks(copies)
        if len(chunks) == 1 and chunks[0].num_tokens == 1:
            native = self.native.get()
            if native is not None and self._unhooked():  # the hot path as one call
                seq, p = chunks[0].seq, chunks[0].start
                return native(seq.token_ids[p], p, seq.block_table)[0].float()
        lean = self._lean_forward()
        batch = self.prepare(chunks)
        self.batch = batch
        try:
            if lean is not None:
                # one row (the hot path) is F.linear either way: skip the wrapper's checks
                packed = self.linear.enabled and batch.single is None
                extra = {"linear": self.linear} if packed else {}
                logits = lean(batch.input_ids, batch.positions, batch.logits_indices, **extra)
            else:
                logits = self.model(
                    batch.input_ids, positions=batch.positions, logits_to_keep=batch.logits_indices
                )
        finally:
            self.batch = None
        return logits[0].float()

    def _prepare_single(self, chunk: Chunk) -> PagedBatch | None:
        """The hot path's batch: one decode token of a sequence whose blocks are consecutive
        (None otherwise). Two one-element tensors and three host integers; nothing per layer."""
        bs = self.config.block_size
        seq, p = chunk.seq, chunk.start
        first = _consecutive_start(seq.block_table, p // bs + 1)
        if first is None:
            return None
        device = self.device
        return PagedBatch(
            input_ids=torch.tensor([[seq.token_ids[p]]], device=device),
            positions=torch.tensor([[p]], device=device),
            slot_mapping=None,
            layout=None,
            logits_indices=0,
            single=(first * bs + p, first * bs, p + 1),
        )

    def _prepare_each(self, chunks: list[Chunk]) -> PagedBatch:
        """A step of a few decodes (see ``_attend_each``): the new tokens' slots, and where
        each sequence's keys are (first slot and length, or every key's slot)."""
        bs = self.config.block_size
        ids, positions, slots, each = [], [], [], []
        for chunk in chunks:
            seq, p = chunk.seq, chunk.start
            n = p // bs + 1
            table = seq.block_table[:n]
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(table[-1] * bs + p % bs)
            first = _consecutive_start(table, n)
            if first is not None:
                each.append((first * bs, p + 1))
            else:
                blocks = torch.tensor(table, device=self.device)
                each.append((blocks[:, None] * bs + self._block_offsets).view(-1)[: p + 1])
        device = self.device
        return PagedBatch(
            input_ids=torch.tensor([ids], device=device),
            positions=torch.tensor([positions], device=device),
            slot_mapping=torch.tensor(slots, device=device),
            layout=None,
            logits_indices=0,
            each=each,
        )

    def _lean_forward(self) -> Any:
        """The model's ``inference_forward`` while it is safe to skip ``nn.Module`` dispatch:
        its layers are the ones it spells out (checked once, when the runner is built), eval
        mode and no hook anywhere (a hook would be silently skipped), else None."""
        return self._lean if self._unhooked() else None

    def _unhooked(self) -> bool:
        """Eval mode and no forward hook anywhere: the lean forward and the native step skip
        ``nn.Module.__call__``, so a hook (or dropout) would be silently skipped otherwise."""
        if self.model.training:
            return False
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return False
        return not any(self._hook_dicts)


class NativeStep:
    """The model's ``native_decode_step`` over the runner's pool (None where the model offers
    none, it does not apply, ``EngineConfig.native_step`` is off, or the model is not on a CPU:
    a GPU step is kernel launches, and there the Triton paged-attention kernel and CUDA graphs
    are the levers), built once. A deep copy
    builds its own from the copied model and pool when first asked: an engine's model holds its
    runner (the attention it swapped in), and a compiled step cannot be copied."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._built = False
        self._step: Any = None

    def get(self) -> Any:
        if not self._built:
            runner = self.runner
            offer = getattr(runner.model, "native_decode_step", None)
            if runner.config.native_step and runner.device.type == "cpu" and callable(offer):
                self._step = offer(runner.pool.keys, runner.pool.values)
            self._built = True
        return self._step

    def __deepcopy__(self, memo: dict) -> NativeStep:
        return NativeStep(copy.deepcopy(self.runner, memo))


def _consecutive_start(table: list[int], n: int) -> int | None:
    """The first block of ``table[:n]`` when those blocks are consecutive in the pool (a view
    then reaches them all), else None."""
    first = table[0]
    if table[n - 1] - first != n - 1 or table[:n] != list(range(first, first + n)):
        return None
    return first
