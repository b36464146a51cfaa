"""Paged attention test cases: random keys scattered over a shuffled block pool, and the
contiguous-cache oracle they must agree with (shared by the kernel and serving tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.kernels import PagedLayout


@dataclass
class PagedCase:
    q: Tensor  # (N, H, D) packed queries
    keys: list[Tensor]  # per sequence, contiguous (L, H_kv, D)
    values: list[Tensor]
    k_cache: Tensor  # (num_blocks, block_size, H_kv, D)
    v_cache: Tensor
    block_tables: Tensor
    query_start: Tensor
    context_lens: Tensor

    @property
    def layout(self) -> PagedLayout:
        return PagedLayout(self.block_tables, self.query_start, self.context_lens,
                           self.k_cache.shape[1])  # fmt: skip

    @property
    def args(self) -> tuple[Tensor, Tensor, Tensor, PagedLayout]:
        return self.q, self.k_cache, self.v_cache, self.layout


def scatter_to_pool(
    context_lens: list[int],
    new_tokens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 3,
    shuffle: bool = True,
) -> PagedCase:
    """Sequence ``b`` has ``context_lens[b]`` keys, the last ``new_tokens[b]`` of them with a
    query each; its blocks are a random, non-contiguous choice from a pool with spare blocks
    full of noise (so reading a wrong block shows). ``shuffle=False`` gives each sequence
    consecutive blocks (the reference then reads its keys as one slice of the pool)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle else list(range(num_blocks))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables, keys, values, queries, starts = [], [], [], [], [0]
    for L, n, nb in zip(context_lens, new_tokens, need):
        table, order = order[:nb], order[nb:]
        k = torch.randn(L, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(L, kv_heads, head_dim, generator=g).to(dtype)
        for p in range(L):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        tables.append(table + [0] * (max(need) - nb))
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(n, heads, head_dim, generator=g).to(dtype))
        starts.append(starts[-1] + n)
    return PagedCase(
        q=torch.cat(queries),
        keys=keys,
        values=values,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
    )


def contiguous_attention(case: PagedCase) -> Tensor:
    """float64 causal SDPA of each sequence's queries over its contiguous keys (queries last)."""
    out = []
    starts = case.query_start.tolist()
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        q = case.q[starts[b] : starts[b + 1]].double().transpose(0, 1)[None]  # (1, H, n, D)
        k, v = (t.double().transpose(0, 1)[None] for t in (k, v))  # (1, H_kv, L, D)
        n, L = q.shape[2], k.shape[2]
        mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)
