"""A GPT (decoder-only transformer) that is plain PyTorch and ready to be split and sharded.

Three contracts from docs/architecture.md#contracts shape this module:

* **Pipeline**: ``GPT.pipeline_layers()`` is ``[embed, *blocks, head]``; each maps one tensor to
  one tensor (ids -> hidden -> hidden -> logits), and their composition is ``GPT.forward``.
* **Tensor parallel**: ``GPT.tensor_parallel_plan()`` names the layers to shard. The fused qkv
  projection stores its output rows head by head (``[q_h, k_h, v_h]`` for each head ``h``), as
  Megatron-LM does, so a contiguous column shard holds whole heads; attention reads its local
  head count from the (possibly sharded) weight, never from ``config.n_head``.
* **Decoding**: ``forward(input_ids, cache=None, positions=None, attention_mask=None)`` with a
  preallocated ``KVCache`` from ``new_cache(batch_size, max_len)``; positions follow the
  attention mask for left-padded batches, as HF does.

The layer layout mirrors GPT-2 so that ``GPT.from_hf_gpt2`` is a renaming (plus the qkv
reordering above) and logits match ``transformers.GPT2LMHeadModel``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.models.gpt_config import GPTConfig
from llmlab.models.kv_cache import KVCache
from llmlab.models.masks import attention_bias, resolve_positions
from llmlab.models.ops import Ops, get_ops

if TYPE_CHECKING:  # transformers is an optional, test-time dependency
    from transformers import GPT2LMHeadModel


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, computed by the configured op backend."""

    def __init__(self, dim: int, bias: bool, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused, head-interleaved qkv projection."""

    def __init__(self, config: GPTConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    @property
    def local_heads(self) -> int:
        """Heads held by this module: all of them, or this rank's share once qkv is sharded."""
        return self.qkv.weight.shape[0] // (3 * self.head_dim)

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = True,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        # (B, T, H, 3, D): each head's q, k and v are adjacent, so a column shard keeps heads whole.
        qkv = self.qkv(x).view(B, T, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # each (B, H, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is None and causal:
            docs = {} if document_ids is None else {"document_ids": document_ids}
            y = self.ops.attention(q, k, v, causal=True, dropout_p=dropout_p, **docs)
        else:  # decoding: an explicit mask, or one new token that may see every cached key
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, ops: Ops) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.ops.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps, ops)
        self.attn = CausalSelfAttention(config, layer_idx, ops)
        self.ln_2 = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = True,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        # ids by keyword: sequence parallelism gathers only the first positional input
        x = x + self.attn(self.ln_1(x), cache, attn_mask, causal, document_ids=document_ids)
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings (the first pipeline layer: ids -> hidden)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self, input_ids: Tensor, positions: Tensor | None = None, last_position: int | None = None
    ) -> Tensor:
        """``last_position``: the largest of ``positions`` when the caller knows it on the host;
        the check against ``block_size`` then needs no device read (one per step otherwise)."""
        if positions is None:  # (1, T): batch-major like the ids, as sequence sharding expects
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            last_position = input_ids.shape[1] - 1
        if last_position is None:
            last_position = int(positions.max())
        if last_position >= self.block_size:
            raise ValueError(
                f"position {last_position} is beyond the model's block_size "
                f"{self.block_size}; sequences may hold at most {self.block_size} tokens"
            )
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Head(nn.Module):
    """Final LayerNorm and the LM head (the last pipeline layer: hidden -> logits)."""

    def __init__(self, config: GPTConfig, ops: Ops) -> None:
        super().__init__()
        self.ln_f = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps, ops)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def _plain_linear(x: Tensor, module: nn.Linear) -> Tensor:
    return F.linear(x, module.weight, module.bias)


class _SlotWriter:
    """The cache seen by ``GPT.decode_step``: writes the new key/value at a tensor index and
    hands back the whole preallocated buffers (static shapes, no Python-int slicing)."""

    def __init__(self, cache: KVCache, index: Tensor) -> None:
        self.cache, self.index = cache, index

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.index, k)
        values.index_copy_(2, self.index, v)
        return keys, values


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(input_ids) -> logits`` of shape (B, T, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        ops = get_ops(config.kernels)
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, i, ops) for i in range(config.n_layer))
        self.head = Head(config, ops)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream's variance stays put.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits for ``input_ids`` (B, T).

        ``cache``: a ``KVCache`` from ``new_cache``; the new tokens are appended to it.
        ``attention_mask``: (B, past + T) with 1 for real tokens and 0 for (left) padding.
        ``positions``: (B, T) position ids; by default derived from the mask (or the cache).
        ``logits_to_keep``: if > 0, only the last that many positions go through the LM head; a
        LongTensor of positions keeps exactly those (HF's convention).
        ``document_ids``: (B, T) ids of the packed documents, non-decreasing per row (training):
        attention stays inside each document and positions restart at each document's start.
        """
        past = cache.length if cache is not None else 0
        T = input_ids.shape[1]
        last_position = None  # without padding it is past + T - 1, known here
        if positions is None and document_ids is None and attention_mask is None:
            last_position = past + T - 1
        positions = resolve_positions(
            input_ids, positions, past, attention_mask, document_ids, cache is not None
        )
        # Without padding, a fresh sequence is plainly causal and a single new token may attend to
        # every cached key: neither needs a mask tensor, so the fused causal kernel stays in use.
        attn_mask = None
        if attention_mask is not None or (past > 0 and T > 1):
            attn_mask = attention_bias(input_ids, past, attention_mask)
        causal = past == 0
        x = self.embed(input_ids, positions, last_position)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        for block in self.blocks:
            x = block(x, cache, attn_mask, causal, **docs)
        if cache is not None:
            cache.advance(T)
        if isinstance(logits_to_keep, Tensor):  # HF's meaning: the positions to keep
            x = x[:, logits_to_keep]
        elif logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return self.head(x)

    def inference_forward_applies(self) -> bool:
        """Whether :meth:`inference_forward` computes what ``forward`` does for this model: every
        submodule is one of the classes it spells out. A replaced or wrapped layer (a LoRA
        adapter, an fp8 or quantized Linear, any subclass) has a forward of its own, which the
        direct calls would skip silently. Hooks are the caller's to check (they can come and go).
        """
        plain = (GPT, Embedding, Block, CausalSelfAttention, MLP, LayerNorm, Head,
                 nn.Linear, nn.Embedding, nn.Dropout, nn.ModuleList)  # fmt: skip
        return all(type(m) in plain for m in self.modules())

    def inference_forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        logits_to_keep: int | Tensor = 0,
        linear: Callable[[Tensor, nn.Linear], Tensor] | None = None,
    ) -> Tensor:
        """``forward(input_ids, positions=positions, logits_to_keep=...)`` in eval mode, without
        ``nn.Module`` dispatch: the same functions on the same tensors in the same order, so the
        logits are bit-identical (the serving engine's hot path, see llmlab.serving).

        Why: a batch-1 decode step of a small model is ~60 module calls and ~100 tiny ops
        around 17 matrix-vector products; the calls' bookkeeping (hook checks, ``__getattr__``,
        dropout no-ops) costs a third of the step on a CPU. Skipping ``Module.__call__`` also
        skips hooks, so the caller must make sure none are registered (the engine checks;
        tensor parallelism, which works through hooks, never comes here), and
        :meth:`inference_forward_applies` must hold. No cache, no mask,
        no dropout; ``positions`` (1, N) must lie below ``block_size`` (not checked: the caller
        knows them on the host).

        ``linear(x, module)``: how each ``nn.Linear`` product is computed (default: ``F.linear``
        of its weight and bias, as its forward does); the serving engine passes its own (oneDNN
        on packed weights, ``llmlab.serving.linear``), equal up to fp32 rounding.
        """
        lin = _plain_linear if linear is None else linear
        x = F.embedding(input_ids, self.embed.wte.weight) + F.embedding(
            positions, self.embed.wpe.weight
        )
        for block in self.blocks:
            attn, mlp, ln_1, ln_2 = block.attn, block.mlp, block.ln_1, block.ln_2
            B, T, _ = x.shape
            heads, dim = attn.local_heads, attn.head_dim
            h = ln_1.ops.layer_norm(x, ln_1.weight, ln_1.bias, ln_1.eps)
            qkv = lin(h, attn.qkv).view(B, T, heads, 3, dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # forward's views, one call
            y = attn.ops.attention(q, k, v, causal=True, dropout_p=0.0)
            y = y.transpose(1, 2).reshape(B, T, heads * dim)
            x = x + lin(y, attn.proj)
            h = ln_2.ops.layer_norm(x, ln_2.weight, ln_2.bias, ln_2.eps)
            h = mlp.ops.gelu(lin(h, mlp.fc))
            x = x + lin(h, mlp.proj)
        if isinstance(logits_to_keep, Tensor):
            x = x[:, logits_to_keep]
        elif logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        ln_f = self.head.ln_f
        x = ln_f.ops.layer_norm(x, ln_f.weight, ln_f.bias, ln_f.eps)
        return lin(x, self.head.lm_head)

    def native_decode_step(self, keys: list[Tensor], values: list[Tensor]) -> Any:
        """This model's one-token step as one native call over per-layer KV pools, or None where
        it does not apply or cannot be built: see :func:`llmlab.models.native.gpt_decode_step`
        (the serving engine's hot path uses it; logits equal to ``forward``'s to fp32
        rounding)."""
        from llmlab.models.native import gpt_decode_step

        return gpt_decode_step(self, keys, values)

    def decode_step(
        self, input_ids: Tensor, cache: KVCache, index: Tensor, positions: Tensor, key_mask: Tensor
    ) -> Tensor:
        """One decoding step with static shapes, for ``torch.compile`` (and CUDA graphs).

        ``input_ids`` and ``positions``: (B, 1); ``index``: a 1-element LongTensor, the cache slot
        to write (the same for every row); ``key_mask``: (B, max_len) bool, True for the cached
        keys each row may see (its own new slot included). Every layer attends over all
        ``max_len`` slots of the preallocated cache with that mask, so no shape depends on how
        far decoding has got: one compiled graph serves every step. Returns logits (B, 1, V);
        the caller advances the cache. Same maths as ``forward`` with the cache (the masked
        slots contribute exact zeros to the softmax).
        """
        x = self.embed.drop(self.embed.wte(input_ids) + self.embed.wpe(positions))
        slots = _SlotWriter(cache, index)
        mask = key_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, slots, mask, False)
        return self.head(x)

    # ----------------------------------------------------------------------- contracts
    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A preallocated key/value cache for ``batch_size`` sequences of ``max_len`` tokens."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={self.config.block_size}"
            )
        ref = self.embed.wte.weight
        heads = self.blocks[0].attn.local_heads if len(self.blocks) else self.config.n_head
        return KVCache(
            n_layer=self.config.n_layer,
            batch_size=batch_size,
            n_head=heads,
            head_dim=self.config.head_dim,
            max_len=max_len,
            dtype=dtype or ref.dtype,
            device=ref.device,
        )

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embed, *blocks, head]``: each maps one tensor to one tensor, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def repeated_blocks(self) -> list[nn.Module]:
        """The transformer blocks: what activation checkpointing wraps and compile compiles."""
        return list(self.blocks)

    def swap_attention(self, wrap: Any) -> int:
        """Replace each block's attention function ``fn`` by ``wrap(fn)``; returns the count."""
        for block in self.blocks:
            attn = block.attn
            attn.ops = replace(attn.ops, attention=wrap(attn.ops.attention))
        return len(self.blocks)

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """Sizes a tensor-parallel degree must divide: whole heads, hidden and vocab shards."""
        c = self.config
        return {"n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size}

    @staticmethod
    def tensor_parallel_plan() -> dict[str, str]:
        """Which modules to shard and how (Megatron-LM's layout; see llmlab.parallel.tensor)."""
        return {
            "embed.wte": "vocab",
            "blocks.*.attn.qkv": "colwise",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
            "head.lm_head": "vocab",
        }

    # ------------------------------------------------------------------------ metrics
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default (they cost no matmul)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·H·D·T."""
        c = self.config
        T = seq_len or c.block_size
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_embd * T

    # ------------------------------------------------------------------- conversions
    @classmethod
    def from_hf_gpt2(cls, hf_model: GPT2LMHeadModel, kernels: str = "torch") -> GPT:
        """An llmlab GPT with the config and weights of an in-memory HF ``GPT2LMHeadModel``,
        through the same conversion as ``llmlab.models.from_pretrained`` (which reads a folder):
        GPT-2's Conv1D weights transposed, its fused qkv reordered head by head, and every
        config field it cannot reproduce exactly refused by name."""
        from llmlab.models.hf.convert import model_from_hf_state

        return model_from_hf_state(
            cls, GPTConfig, hf_model.config.to_dict(), hf_model.state_dict(), {"kernels": kernels}
        )
