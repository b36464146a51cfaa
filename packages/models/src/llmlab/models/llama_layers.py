"""The Llama's layers: RMSNorm, grouped-query attention with RoPE, multi-head latent attention
(DeepSeek-V3's), the gated MLP, the block, the embedding and the head. Their names and shapes
mirror ``transformers``' ``LlamaForCausalLM`` and ``DeepseekV3ForCausalLM`` (``q_proj``,
``kv_a_proj_with_mqa``, ``gate_proj``, ...), so converting a checkpoint is a renaming."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.models.attention import AttentionContext
from llmlab.models.linear import Linear
from llmlab.models.llama_config import LlamaConfig
from llmlab.models.moe import MoE
from llmlab.models.ops import Ops
from llmlab.models.quantize import output_width
from llmlab.models.rope import Rotary, deinterleave, softmax_scale


class RMSNorm(nn.Module):
    """``w · x / sqrt(mean(x²) + eps)``, computed by the configured op backend."""

    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; separate q, k, v projections (head-major rows).

    With ``qk_norm`` each head of q and k goes through an RMSNorm of width ``head_dim`` before
    RoPE (Qwen3). A layer's sliding window goes to the attention context with its keys.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        C, D = config.n_embd, config.head_size
        self.head_dim = D
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.q_proj = Linear(C, config.n_head * D, bias=config.attention_bias)
        self.k_proj = Linear(C, config.n_kv_head * D, bias=config.attention_bias)
        self.v_proj = Linear(C, config.n_kv_head * D, bias=config.attention_bias)
        self.o_proj = Linear(config.n_head * D, C, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(D, config.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = Rotary(D, config.rope_theta, config.rope_scaling)
        self.interleave = config.rope_interleave
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    @property
    def local_heads(self) -> int:
        """Query heads held here: all of them, or this rank's share once q_proj is sharded."""
        return output_width(self.q_proj) // self.head_dim

    @property
    def local_kv_heads(self) -> int:
        """Key/value heads held here (what the KV cache stores)."""
        return output_width(self.k_proj) // self.head_dim

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        attention: AttentionContext | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        # (B, T, heads, D): token-major, as the projections produce them; RoPE works there, then
        # the heads move forward for attention. The head counts are whatever the (possibly
        # sharded) projections return -- a plain, Megatron-sharded or DTensor-sharded q_proj.
        q = self.q_proj(x).view(B, T, -1, D)
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.interleave:  # adjacent pairs -> rotate-half pairs (the same q·k)
            q, k = deinterleave(q), deinterleave(k)
        if positions is None:  # a block run on its own (a pipeline stage): a fresh sequence
            positions = torch.arange(T, device=x.device).unsqueeze(0)
        cos, sin = self.rotary(positions, q.dtype)
        q, k = self.ops.rope(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, T, D)
        if attention is not None:  # decoding, serving: the context knows the keys
            y = attention.attend(self.layer_idx, q, k, v, window=self.window)
        else:  # training: causal over the row (or its documents), through the layer's op
            dropout_p = self.dropout if self.training else 0.0
            if self.window is not None and self.window < T:  # a window inside the row
                mask = _window_mask(T, self.window, x.device)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                   enable_gqa=True)  # fmt: skip
            else:
                docs = {} if document_ids is None else {"document_ids": document_ids}
                y = self.ops.attention(q, k, v, causal=True, dropout_p=dropout_p, **docs)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.o_proj(y))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), through the same attention context.

    Per token: ``c_kv, k_rope = kv_a_proj_with_mqa(x)`` -- a latent of ``kv_lora_rank`` (r) and
    one RoPE key of ``qk_rope_head_dim`` (d_r) shared by every head --, ``c = RMSNorm(c_kv)``,
    then per head ``[k_nope_h | v_h] = W_h c`` (``kv_b_proj``, W_h = [W_UK_h; W_UV_h]); queries
    ``q_b_proj(RMSNorm(q_a_proj(x)))`` (``q_proj(x)`` without ``q_lora_rank``), each head split
    into ``qk_nope_head_dim`` + d_r. RoPE turns only the rope parts (adjacent pairs with
    ``rope_interleave``); head h's key is ``[k_nope_h | k_rope]``. Softmax scale:
    ``qk_head_dim^-0.5`` times YaRN's ``mscale_all_dim`` correction squared
    (:func:`llmlab.models.rope.softmax_scale`). The two latent norms use eps 1e-6 whatever
    ``rms_norm_eps`` is, as ``transformers`` does.

    Two orders of the same products, chosen by where the keys live:

    * **no context** (training): expanded, as written above -- per-head keys of ``qk_head_dim``
      and values of ``v_head_dim`` through the layer's attention op;
    * **a context** (a KV cache, the serving engine's paged pool, a padded batch): absorbed, so
      that what the context keeps is the compressed latent. Since
      ``q_nope_h · k_nope_h = (W_UK_hᵀ q_nope_h) · c``, the layer hands ``attend`` a
      multi-*query* problem: queries ``[W_UK_hᵀ q_nope_h | q_rope_h]`` (H heads of width
      r + d_r), one key head ``[c | k_rope]`` (width r + d_r), and that same tensor as the
      value head; the first r columns of the output are ``Σ p · c``, and ``W_UV_h`` maps them to
      head h's output. The context stores r + d_r numbers per token and layer for the key (and,
      unless it keeps one copy when ``v is k``, the same again for the value) instead of
      ``n_head · (qk_head_dim + v_head_dim)``.

    The context scales by ``1/sqrt(width)``, so the layer hands it ``q`` pre-multiplied by
    ``scale · sqrt(width)``; in the expanded order the narrower of (q, k) and v is zero-padded
    to one width (zeros add nothing to q·k; padded value columns come back as zeros, cut off).
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        C, H = config.n_embd, config.n_head
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope + self.rope_dim
        self.head_dim = self.kv_lora_rank + self.rope_dim  # the width a context keeps
        self.layer_idx = layer_idx
        self.window = None
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = Linear(C, H * self.qk_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(C, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(config.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(C, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, C, bias=config.attention_out_bias)
        self.rotary = Rotary(self.rope_dim, config.rope_theta, config.rope_scaling)
        self.interleave = config.rope_interleave
        self.scale = softmax_scale(config.rope_scaling, self.qk_dim)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    @property
    def local_heads(self) -> int:
        """Heads held here (all, or a rank's share once ``kv_b_proj`` is sharded by heads)."""
        return output_width(self.kv_b_proj) // (self.nope + self.v_dim)

    @property
    def local_kv_heads(self) -> int:
        """Key heads a context keeps: one, the latent shared by every head."""
        return 1

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        attention: AttentionContext | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(B, T, -1, self.qk_dim).split([self.nope, self.rope_dim], -1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(c_kv)  # (B, T, r)
        k_rot = k_rot.view(B, T, 1, self.rope_dim)  # one RoPE key, shared by the heads
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        if positions is None:  # a block run on its own (a pipeline stage): a fresh sequence
            positions = torch.arange(T, device=x.device).unsqueeze(0)
        cos, sin = self.rotary(positions, q.dtype)
        q_rot, k_rot = self.ops.rope(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
        if attention is not None:
            y = self._attend_latent(q_nope, q_rot, latent, k_rot, attention)
        else:
            y = self._attend_expanded(q_nope, q_rot, latent, k_rot, document_ids)
        return self.resid_dropout(self.o_proj(y.reshape(B, T, -1)))

    def _attend_expanded(
        self, q_nope: Tensor, q_rot: Tensor, latent: Tensor, k_rot: Tensor, document_ids: Any
    ) -> Tensor:
        """Training: per-head keys and values from ``kv_b_proj`` -> (B, T, H, v_head_dim)."""
        B, T, H, _ = q_nope.shape
        kv = self.kv_b_proj(latent).view(B, T, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(B, T, H, self.rope_dim)), dim=-1)
        D = max(self.qk_dim, self.v_dim)
        q = q * (self.scale * D**0.5)  # the op divides by sqrt(D)
        if self.qk_dim < D:
            q, k = F.pad(q, (0, D - self.qk_dim)), F.pad(k, (0, D - self.qk_dim))
        if self.v_dim < D:
            v = F.pad(v, (0, D - self.v_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        dropout_p = self.dropout if self.training else 0.0
        docs = {} if document_ids is None else {"document_ids": document_ids}
        y = self.ops.attention(q, k, v, causal=True, dropout_p=dropout_p, **docs)
        return y[..., : self.v_dim].transpose(1, 2)

    def _attend_latent(
        self,
        q_nope: Tensor,
        q_rot: Tensor,
        latent: Tensor,
        k_rot: Tensor,
        attention: AttentionContext,
    ) -> Tensor:
        """A context: the absorbed order over the compressed latent -> (B, T, H, v_head_dim)."""
        H, r = q_nope.shape[2], self.kv_lora_rank
        w = dense_weight(self.kv_b_proj, q_nope.dtype).view(H, self.nope + self.v_dim, r)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (H, nope, r), (H, v, r)
        q = torch.cat((torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q_rot), dim=-1)
        q = q * (self.scale * self.head_dim**0.5)  # the context divides by sqrt(r + d_r)
        k = torch.cat((latent.unsqueeze(2), k_rot), dim=-1)  # (B, T, 1, r + d_r)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        out = attention.attend(self.layer_idx, q, k, k, window=None)  # the latent is the value
        return torch.einsum("bhtr,hvr->bthv", out[..., :r], w_uv)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> Tensor:
    """The (out, in) matrix a linear layer applies, in ``dtype``: an ``nn.Linear``'s (or a
    tensor-parallel shard's) weight, a quantized layer's dequantized weight, a LoRA layer's
    base plus its unmerged update."""
    base = getattr(linear, "base_layer", None)
    if base is not None:  # LoRA
        weight = dense_weight(base, dtype)
        if not (linear.merged or linear.disabled):
            weight = weight + linear.delta_weight().to(dtype)
        return weight
    if callable(getattr(linear, "dequantize", None)):
        return linear.dequantize(dtype)
    return linear.weight.to(dtype)


LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for q_a / kv_a norms


def _window_mask(T: int, window: int, device: torch.device) -> Tensor:
    """(1, 1, T, T) boolean mask: query ``i`` sees keys ``(i - window, i]``."""
    i = torch.arange(T, device=device)
    offset = i[:, None] - i[None, :]
    return ((offset >= 0) & (offset < window))[None, None]


class MLP(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, ops: Ops) -> None:
        super().__init__()
        self.gate_proj = Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``; the MLP is a
    mixture of experts (:class:`llmlab.models.moe.MoE`) in the layers the config names."""

    def __init__(self, config: LlamaConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.rms_norm_eps, ops)
        attention = LatentAttention if config.latent_attention else Attention
        self.attn = attention(config, layer_idx, ops)
        self.mlp_norm = RMSNorm(config.n_embd, config.rms_norm_eps, ops)
        self.mlp = (
            MoE(config.moe_config(), ops) if config.is_moe_layer(layer_idx) else MLP(config, ops)
        )

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        attention: AttentionContext | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        # ids by keyword: sequence parallelism gathers only the first positional input
        h = self.attn_norm(x)
        x = x + self.attn(h, positions, attention, document_ids=document_ids)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token embeddings only: positions enter through RoPE inside attention."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.tokens(input_ids))


class Head(nn.Module):
    """Final RMSNorm and the LM head (the last pipeline layer: hidden -> logits)."""

    def __init__(self, config: LlamaConfig, ops: Ops) -> None:
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps, ops)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))
