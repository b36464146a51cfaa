"""Compiled decode steps (``EngineConfig.compile``): the model's one forward through
``torch.compile``, at a few fixed batch sizes.

Why: a decode step at batch 1 reads every weight once, and on a CPU everything else in it (a
few hundred small ops, each finding its data and code evicted from the caches by the megabytes
of weights streamed since the layer before) adds to that. On GPT-2 124M (2 threads) the eager
step spends ~18 ms in its products and ~4 ms in the rest, 1.6 ms of which is the paged
attention's Python between the layers; compiled, the small ops fuse into a few C++ loops and
attention runs inside the graph.

How: a step whose every chunk is one decode token (no prompt rows, no prompt log-probabilities)
and that has at most ``BUCKETS[-1]`` sequences is padded to the next bucket size and run through
``torch.compile(model, dynamic=False, fullgraph=True)``: one graph per bucket, compiled the first
time a step of that size comes (seconds per bucket on a CPU), as vLLM captures CUDA graphs at a
few batch sizes. Its attention context, :class:`PagedDecode`, writes the new keys and values
into their slots, gathers each sequence's blocks through its block table (padded to a common
width with the pool's spare block), masks the keys past each sequence's length and calls SDPA,
all in the graph; the table width (context length in blocks) is the graph's one dynamic size.
Padding rows write into the spare block, which the block manager never hands out, and their
logits are dropped. The linear layers' few-row products stay llmlab's kernel inside the graph
(``llmlab.kernels.cpu_linear``). Every other step (prefill, mixed, speculative verification,
more sequences than the largest bucket) runs the eager forward. ``LLMEngine`` refuses the option
for LoRA adapters and mixture-of-experts models (``engine.check_compilable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.decoding.runner import many_graphs
from llmlab.serving.scheduler import Chunk

# Batch sizes with a compiled graph. Up to 16 rows the few-row kernel reads each weight once
# per eight rows, so padding 9 sequences to 16 costs little; beyond it steps run eagerly.
BUCKETS = (1, 2, 4, 8, 16)


@dataclass(eq=False)
class PagedDecode:
    """The attention context of a compiled decode step: one query per row (see the module
    docstring). ``block_tables`` (B, W) and ``context_lens`` (B,) are padded rows included."""

    keys: list[Tensor]  # per layer (num_blocks + 1, block_size, H_kv, D); + 1: the spare block
    values: list[Tensor]  # values[i] is keys[i] where a layer's values are its keys
    slot_mapping: Tensor  # (B,) the new token's slot, per row
    block_tables: Tensor  # (B, W) int64 block ids, padded with the spare block
    context_lens: Tensor  # (B,) keys per row, the new one included

    def begin(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Any) -> Tensor:
        return positions

    def attend(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None
    ) -> Tensor:
        """``q`` (1, H, B, D), ``k``/``v`` (1, H_kv, B, D) -> (1, H, B, D) in ``q``'s dtype
        (computed in the pool's, as the eager context does)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        heads, dim, dtype = keys.shape[2], keys.shape[3], keys.dtype
        keys.view(-1, heads, dim).index_copy_(0, self.slot_mapping, k[0].transpose(0, 1).to(dtype))
        if values is not keys:
            values.view(-1, heads, dim).index_copy_(
                0, self.slot_mapping, v[0].transpose(0, 1).to(dtype)
            )
        rows, width = self.block_tables.shape
        length = width * keys.shape[1]

        def gather(pool: Tensor) -> Tensor:  # (B, H_kv, W * block_size, D)
            return pool[self.block_tables].view(rows, length, heads, dim).transpose(1, 2)

        k_all = gather(keys)
        v_all = k_all if values is keys else gather(values)
        seen = torch.arange(length, device=keys.device) < self.context_lens[:, None]
        query = q[0].transpose(0, 1)[:, :, None].to(dtype)  # (B, H, 1, D)
        out = F.scaled_dot_product_attention(query, k_all, v_all, attn_mask=seen[:, None, None],
                                             enable_gqa=query.shape[1] != heads)  # fmt: skip
        return out[:, :, 0].transpose(0, 1)[None].to(q.dtype)

    def end(self, num_tokens: int) -> None:
        pass


class CompiledDecode:
    """Runs decode-only steps of up to ``BUCKETS[-1]`` sequences through the compiled forward
    over ``keys``/``values``, whose last block (``spare_block``) is kept for padding rows."""

    def __init__(
        self,
        model: Any,
        keys: list[Tensor],
        values: list[Tensor],
        block_size: int,
        spare_block: int,
        max_num_seqs: int,
    ) -> None:
        self.forward = torch.compile(model, dynamic=False, fullgraph=True)
        self.keys, self.values = keys, values
        self.block_size, self.spare = block_size, spare_block
        largest = min(max_num_seqs, BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b < largest] + [largest]
        self.device = keys[0].device

    def applies(self, chunks: list[Chunk], every_row: Any) -> bool:
        """Whether the step is decodes only (one token per chunk, no prompt rows kept) and fits
        the largest bucket."""
        return (
            not every_row
            and len(chunks) <= self.buckets[-1]
            and all(c.num_tokens == 1 for c in chunks)
        )

    def __call__(self, chunks: list[Chunk]) -> Tensor:
        """Float32 logits (len(chunks), V), one row per chunk, in order."""
        n = len(chunks)
        rows = next(b for b in self.buckets if b >= n)
        bs, spare = self.block_size, self.spare
        # width >= 2: dynamo specialises a dimension of size 1, which would cost a recompile
        width = max(2, *(len(c.seq.block_table) for c in chunks))
        pad = rows - n
        tables = [c.seq.block_table + [spare] * (width - len(c.seq.block_table)) for c in chunks]
        slots = [c.seq.block_table[c.start // bs] * bs + c.start % bs for c in chunks]

        def tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        positions = tensor([c.start for c in chunks] + [0] * pad)
        context = PagedDecode(
            self.keys,
            self.values,
            slot_mapping=tensor(slots + [spare * bs] * pad),
            block_tables=tensor(tables + [[spare] * width] * pad),
            context_lens=tensor([c.start + 1 for c in chunks] + [1] * pad),
        )
        torch._dynamo.mark_dynamic(context.block_tables, 1)
        ids = tensor([c.seq.token_ids[c.start] for c in chunks] + [0] * pad)
        with many_graphs():  # a draft beside its target, several engines: graphs add up
            logits = self.forward(
                ids[None], positions=positions[None], attention=context, logits_to_keep=0
            )
        return logits[0, :n].float()
