"""A GPT (decoder-only transformer) that is plain PyTorch and ready to be split and sharded.

Four contracts from docs/architecture.md#contracts shape this module:

* **Pipeline**: ``GPT.pipeline_layers()`` is ``[embed, *blocks, head]``; each maps one tensor to
  one tensor (ids -> hidden -> hidden -> logits), and their composition is ``GPT.forward``.
* **Tensor parallel**: ``GPT.tensor_parallel_plan()`` names the layers to shard. The fused qkv
  projection stores its output rows head by head (``[q_h, k_h, v_h]`` for each head ``h``), as
  Megatron-LM does, so a contiguous column shard holds whole heads; attention reads its local
  head count from the (possibly sharded) weight, never from ``config.n_head``.
* **One forward, one attention context**: ``forward(input_ids, positions=None, attention=None,
  attention_mask=None, logits_to_keep=0)`` serves training (no context: causal attention),
  decoding (``attention=`` a ``KVCache`` from ``new_cache(batch_size, max_len)``; positions
  follow the attention mask for left-padded batches, as HF does) and serving (the engine's
  paged context); see :mod:`llmlab.models.attention`.

The layer layout mirrors GPT-2 so that ``GPT.from_hf_gpt2`` is a renaming (plus the qkv
reordering above) and logits match ``transformers.GPT2LMHeadModel``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from llmlab.models.attention import AttentionContext, keep_logits, start_forward
from llmlab.models.gpt_config import GPTConfig
from llmlab.models.kv_cache import KVCache
from llmlab.models.linear import Linear
from llmlab.models.ops import Ops, get_ops
from llmlab.models.quantize import output_width

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
        self.qkv = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    @property
    def local_heads(self) -> int:
        """Heads held by this module: all of them, or this rank's share once qkv is sharded."""
        return output_width(self.qkv) // (3 * self.head_dim)

    def forward(
        self,
        x: Tensor,
        attention: AttentionContext | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        # (B, T, H, 3, D): each head's q, k and v are adjacent, so a column shard keeps heads whole.
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each (B, H, T, D)
        if attention is not None:  # decoding, serving: the context knows the keys
            y = attention.attend(self.layer_idx, q, k, v)
        else:  # training: causal over the row (or its documents), through the layer's op
            docs = {} if document_ids is None else {"document_ids": document_ids}
            dropout_p = self.dropout if self.training else 0.0
            y = self.ops.attention(q, k, v, causal=True, dropout_p=dropout_p, **docs)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, ops: Ops) -> None:
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
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
        attention: AttentionContext | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        # ids by keyword: sequence parallelism gathers only the first positional input
        x = x + self.attn(self.ln_1(x), attention, document_ids=document_ids)
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
        if last_position is None and not torch.compiler.is_compiling():  # a compiled step's
            last_position = int(positions.max())  # caller checks its lengths on the host
        if last_position is not None and last_position >= self.block_size:
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
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


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
        positions: Tensor | None = None,
        attention: AttentionContext | None = None,
        attention_mask: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits for ``input_ids`` (B, T): this model's one forward, for training, decoding,
        serving and every parallel layout.

        ``attention``: the context that knows which keys each query sees and keeps new keys and
        values (:mod:`llmlab.models.attention`): a ``KVCache`` from ``new_cache`` for
        decoding, the serving engine's paged context; None for training (causal over the row).
        ``attention_mask``: (B, past + T) with 1 for real tokens and 0 for (left) padding.
        ``positions``: (B, T) position ids; by default the context's (past .. past + T - 1, or
        following the padding mask). ``logits_to_keep``: if > 0, only the last that many
        positions go through the LM head; a LongTensor of positions keeps exactly those (HF's
        convention). ``document_ids``: (B, T) ids of the packed documents, non-decreasing per
        row (training): attention stays inside each document and positions restart at each
        document's start.
        """
        attention, positions, last_position = start_forward(
            attention, input_ids, positions, attention_mask, document_ids
        )
        x = self.embed(input_ids, positions, last_position)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        for block in self.blocks:
            x = block(x, attention, **docs)
        if attention is not None:
            attention.end(input_ids.shape[1])
        return self.head(keep_logits(x, logits_to_keep))

    # ----------------------------------------------------------------------- contracts
    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A preallocated key/value cache for ``batch_size`` sequences of ``max_len`` tokens."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={self.config.block_size}"
            )
        ref = self.head.ln_f.weight  # a norm stays in the compute dtype, quantized or not
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
