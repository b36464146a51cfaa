"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), plain PyTorch, beside the GPT
and with its doors.

What differs from GPT-2, block by block: rotary position embeddings (RoPE) on q and k instead
of a learned position table; RMSNorm instead of LayerNorm; a gated SwiGLU MLP
``down(silu(gate(x)) * up(x))`` instead of GELU; grouped-query attention (GQA): ``n_kv_head``
key/value heads, each shared by ``n_head / n_kv_head`` query heads; no biases (except Qwen2's on
q, k, v); an untied LM head by default. The family's switches (explicit head dim, RoPE scaling,
sliding windows, q/k norms, mixtures of experts) are in :mod:`llmlab.models.llama_config`, the
layers in :mod:`llmlab.models.llama_layers`. Mixtral, Qwen2-MoE and Qwen3-MoE are this model with
the MLP of (some) blocks replaced by :class:`llmlab.models.moe.MoE`; DeepSeek-V3 adds multi-head
latent attention in place of GQA (``LlamaConfig.kv_lora_rank``), YaRN and interleaved RoPE,
sigmoid routing and shared experts after its first dense layers; after a forward,
:meth:`Llama.router_stats` holds each MoE layer's expert load and :meth:`Llama.router_loss` the
routing losses the training side adds.

The contracts of docs/architecture.md#contracts are the GPT's, met the same way:

* **Pipeline**: ``pipeline_layers()`` is ``[embed, *blocks, head]``; a block called with the
  hidden state alone takes positions ``0..T-1`` (training), so RoPE needs nothing passed between
  stages.
* **Tensor parallel**: ``tensor_parallel_plan()`` shards q by heads, k and v by KV heads (so
  ``tensor_parallel_divisors()`` includes ``n_kv_head``), gate and up column-wise, down and o
  row-wise. Separate q/k/v projections make every contiguous column shard hold whole heads, and a
  rank's query heads ``[r·H/tp, (r+1)·H/tp)`` read exactly its KV heads ``[r·H_kv/tp, ...)``.
  Attention takes its local head counts from its (possibly sharded) projections, never the config.
* **One forward, one attention context**: ``forward(input_ids, positions=None, attention=None,
  attention_mask=None, logits_to_keep=0)`` for training, decoding and serving alike
  (:mod:`llmlab.models.attention`); a ``KVCache`` from ``new_cache`` stores only the KV heads:
  a GQA model's cache is ``n_kv_head / n_head`` of a multi-head one's. Positions follow the
  attention mask into the RoPE angles, so left-padded rows decode like unpadded ones.

RoPE uses HF's "rotate half" pairs ``(x_i, x_{i+D/2})`` (see ``llmlab.kernels.rope``), and the
layer layout mirrors ``transformers``' ``LlamaForCausalLM``, so loading a checkpoint
(``llmlab.models.from_pretrained``, ``Llama.from_hf``) is a renaming and logits match it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from llmlab.models.attention import AttentionContext, keep_logits, start_forward
from llmlab.models.kv_cache import KVCache
from llmlab.models.llama_config import LlamaConfig
from llmlab.models.llama_layers import Block, Embedding, Head
from llmlab.models.moe import MoE, MoEStats, load_balancing_loss
from llmlab.models.ops import get_ops

if TYPE_CHECKING:  # transformers is an optional, test-time dependency
    from transformers import PreTrainedModel

__all__ = ["Llama", "LlamaConfig"]


class Llama(nn.Module):
    """Decoder-only transformer, Llama layout; ``forward(input_ids) -> logits`` (B, T, vocab)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        ops = get_ops(config.kernels)
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, i, ops) for i in range(config.n_layer))
        self.head = Head(config, ops)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.tokens.weight
        self.apply(self._init_weights)
        # As GPT-2: the projections that write into the residual stream are scaled down so its
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
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
        values (:mod:`llmlab.models.attention`): a ``KVCache`` from ``new_cache`` for decoding,
        the serving engine's paged context; None for training (causal over the row, each
        layer's sliding window applied). ``attention_mask``: (B, past + T) with 1 for real
        tokens and 0 for (left) padding. ``positions``: (B, T) position ids, the RoPE angles'
        positions; by default the context's (following the padding mask). ``logits_to_keep``:
        if > 0, only the last that many positions go through the LM head; a LongTensor of
        positions keeps exactly those (HF's convention). ``document_ids``: (B, T) ids of packed
        documents, non-decreasing per row (training): attention stays inside each document, RoPE
        positions restart at each one's start.
        """
        T = input_ids.shape[1]
        self._check_documents(document_ids, T)
        attention, positions, last_position = start_forward(
            attention, input_ids, positions, attention_mask, document_ids
        )
        self._check_positions(positions, last_position)
        x = self.embed(input_ids)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        for block in self.blocks:
            x = block(x, positions, attention, **docs)
        if attention is not None:
            attention.end(T)
        return self.head(keep_logits(x, logits_to_keep))

    def _check_positions(self, positions: Tensor, last_position: int | None) -> None:
        """Positions past ``block_size`` refused (RoPE would extrapolate silently). Read from the
        device only where the host does not know them, and never inside a compiled step (its
        caller checks its lengths on the host)."""
        if last_position is None and not torch.compiler.is_compiling():
            last_position = int(positions.max())
        if last_position is not None and last_position >= self.config.block_size:
            raise ValueError(
                f"position {last_position} is beyond the model's block_size "
                f"{self.config.block_size}; sequences may hold at most "
                f"{self.config.block_size} tokens"
            )

    def _check_documents(self, document_ids: Tensor | None, T: int) -> None:
        """A sliding window narrower than the row takes the explicit-mask path, which the
        document ids do not reach: refused rather than silently attending across documents."""
        windows = [b.attn.window for b in self.blocks if b.attn.window is not None]
        if document_ids is not None and windows and min(windows) < T:
            raise ValueError(
                f"document_ids with a sliding window of {min(windows)} tokens over rows of {T} "
                "are not supported; use rows no longer than the window"
            )

    # ----------------------------------------------------------------------- contracts
    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A preallocated cache of the *KV* heads only: ``n_kv_head / n_head`` of an MHA cache;
        with latent attention, the compressed latent once (``kv_lora_rank + qk_rope_head_dim``
        per token and layer)."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={self.config.block_size}"
            )
        ref = self.head.norm.weight  # a norm stays in the compute dtype, quantized or not
        attn = self.blocks[0].attn if len(self.blocks) else None
        return KVCache(
            n_layer=self.config.n_layer,
            batch_size=batch_size,
            n_head=attn.local_kv_heads if attn is not None else self.config.n_kv_head,
            head_dim=attn.head_dim if attn is not None else self.config.head_size,
            values_are_keys=self.config.latent_attention,  # the latent, kept once
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
        """Replace each block's attention function ``fn`` by ``wrap(fn)``; returns the count.

        The function receives GQA's shapes: q (B, H, T, D), k and v (B, H_kv, T, D). Refused
        when a layer's sliding window is shorter than the context: that layer attends through
        an explicit mask, which the wrapped function would never see.
        """
        c = self.config
        short = [i for i in range(c.n_layer) if (c.layer_window(i) or c.block_size) < c.block_size]
        if short:
            raise ValueError(
                f"swap_attention: layers {short} use a sliding window of {c.sliding_window} < "
                f"block_size={c.block_size} keys, which a wrapped causal attention function "
                "cannot apply; set model.block_size <= the window to use it"
            )
        for block in self.blocks:
            attn = block.attn
            attn.ops = replace(attn.ops, attention=wrap(attn.ops.attention))
        return len(self.blocks)

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """Sizes a tensor-parallel degree must divide: whole query heads (and KV heads, except
        under latent attention, whose one latent every rank keeps whole), the width of every
        MLP the plan shards, the hidden size and the vocabulary."""
        c = self.config
        sizes = {"n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size}
        if not c.latent_attention:
            sizes["n_kv_head"] = c.n_kv_head
        sizes.update(self._sharded_mlps().values())
        return sizes

    def _sharded_mlps(self) -> dict[str, tuple[str, int]]:
        """The gated MLPs tensor parallelism shards, by module pattern: ``(config field, width)``
        of the dense MLPs (where some layer has one) and of a MoE layer's shared expert."""
        c = self.config
        mlps = {}
        if any(not c.is_moe_layer(i) for i in range(c.n_layer)):
            mlps["blocks.*.mlp"] = ("intermediate_size", c.intermediate_size)
        if c.num_experts and c.shared_expert_intermediate_size:
            width = ("shared_expert_intermediate_size", c.shared_expert_intermediate_size)
            mlps["blocks.*.mlp.shared_expert"] = width
        return mlps

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Which modules to shard and how (Megatron-LM's layout; see llmlab.parallel.tensor).

        Attention by heads: GQA's q by query heads, k and v by KV heads, o row-wise; latent
        attention's query projection and ``kv_b_proj`` (the latent's per-head up-projection)
        by heads, ``o_proj`` row-wise, while the down-projections to the latent
        (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms stay whole on every rank. A dense
        MLP (and a MoE layer's shared experts): gate and up column-wise, down row-wise. A MoE
        layer's router and routed experts are not named: they are replicated over the tensor
        group (Megatron-Core's ``expert_tensor_parallel_size=1``), and expert parallelism, not
        tensor parallelism, splits the experts."""
        c = self.config
        plan = {"embed.tokens": "vocab"}
        if c.latent_attention:
            q = "q_proj" if c.q_lora_rank is None else "q_b_proj"
            plan |= {f"blocks.*.attn.{q}": "colwise", "blocks.*.attn.kv_b_proj": "colwise"}
        else:
            plan |= {
                "blocks.*.attn.q_proj": "colwise",  # by query heads
                "blocks.*.attn.k_proj": "colwise",  # by KV heads
                "blocks.*.attn.v_proj": "colwise",
            }
        plan["blocks.*.attn.o_proj"] = "rowwise"
        for mlp in self._sharded_mlps():
            plan |= {
                f"{mlp}.gate_proj": "colwise",
                f"{mlp}.up_proj": "colwise",
                f"{mlp}.down_proj": "rowwise",
            }
        plan["head.lm_head"] = "vocab"
        return plan

    # -------------------------------------------------------------------- experts
    def moe_layers(self) -> dict[int, MoE]:
        """The mixture-of-experts MLPs by layer index (empty for a dense model)."""
        return {i: b.mlp for i, b in enumerate(self.blocks) if isinstance(b.mlp, MoE)}

    def router_stats(self) -> dict[int, MoEStats]:
        """Each MoE layer's statistics from the last forward: tokens per expert, dropped
        assignments, router probabilities (``.summary()`` gives max/mean load, aux and z-loss
        as numbers). Only the layers held here: a pipeline stage's (the others' are freed,
        left on the ``meta`` device)."""
        held = {i: m for i, m in self.moe_layers().items() if not m.router.weight.is_meta}
        stats = {i: m.stats for i, m in held.items()}
        missing = [i for i, s in stats.items() if s is None]
        if missing:
            raise ValueError(f"router_stats: MoE layers {missing} have not run a forward yet")
        return stats

    def router_aux_loss(self, attention_mask: Tensor | None = None) -> Tensor:
        """The load-balancing loss of the last forward over all MoE layers, exactly as
        ``transformers`` returns it as ``aux_loss`` (``output_router_logits=True``): counts and
        probabilities pooled over the layers; padding (``attention_mask`` 0) excluded."""
        stats = list(self.router_stats().values())
        return load_balancing_loss(stats, self.config.num_experts_per_tok, attention_mask)

    def router_loss(self, attention_mask: Tensor | None = None) -> Tensor:
        """What the training side adds to the LM loss after a forward:
        ``router_aux_loss_coef · aux + router_z_loss_coef · mean over layers of the z-loss``."""
        c = self.config
        stats = list(self.router_stats().values())
        loss = c.router_aux_loss_coef * self.router_aux_loss(attention_mask)
        if c.router_z_loss_coef:
            z = torch.stack([s.z_loss() for s in stats]).mean()
            loss = loss + c.router_z_loss_coef * z
        return loss

    def router_loss_coefficients(self) -> tuple[float, float]:
        """``(router_aux_loss_coef, router_z_loss_coef)``: how much of each routing loss the
        training side adds to the loss it differentiates (``llmlab.train.routing``, which
        computes the losses over the whole global batch on any data-parallel layout)."""
        return self.config.router_aux_loss_coef, self.config.router_z_loss_coef

    def update_router_bias(
        self, rate: float, tokens_per_expert: dict[int, Tensor] | None = None
    ) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing step on every MoE layer (see
        :meth:`llmlab.models.moe.MoE.update_bias`), from ``tokens_per_expert`` by layer index
        (counts summed over a step's micro-batches and data ranks) or the last forward's loads."""
        for i, layer in self.moe_layers().items():
            layer.update_bias(rate, None if tokens_per_expert is None else tokens_per_expert[i])

    # ------------------------------------------------------------------------ metrics
    def active_params(self) -> int:
        """Parameters one token's forward uses: :meth:`num_params` less the routed experts a
        token does not visit (``(E - k) / E`` of each MoE layer's expert weights)."""
        n = self.num_params()
        for layer in self.moe_layers().values():
            c = layer.config
            expert = sum(p.numel() for p in layer.experts.parameters())
            n -= expert * (c.num_experts - c.top_k) // c.num_experts
        return n

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the input embedding table is excluded by default (a lookup costs no
        matmul) unless it is tied to the LM head, which does."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.embed.tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·H·D·T
        (full attention: a sliding window's saving is not counted).

        GQA shrinks N (smaller k/v projections) but not the attention term: every query head
        still scores every key. A mixture of experts counts the parameters a token uses
        (:meth:`active_params`): k of E experts. Latent attention (training's expanded order)
        scores over ``qk_head_dim`` and sums values of ``v_head_dim``: ``D`` is their mean.
        """
        c = self.config
        T = seq_len or c.block_size
        D = (c.head_size + c.v_head_dim) / 2 if c.latent_attention else c.head_size
        return 6.0 * self.active_params() + 12.0 * c.n_layer * c.n_head * D * T

    # ------------------------------------------------------------------- conversions
    @classmethod
    def from_hf(cls, hf_model: PreTrainedModel, kernels: str = "torch") -> Llama:
        """An llmlab Llama with the config and weights of an in-memory HF ``LlamaForCausalLM``
        (or Mistral / Qwen2 / Qwen3 causal LM), through the same conversion as
        ``llmlab.models.from_pretrained`` (which reads a folder instead): anything it cannot
        reproduce exactly is refused with the field named."""
        from llmlab.models.hf.convert import model_from_hf_state

        return model_from_hf_state(
            cls, LlamaConfig, hf_model.config.to_dict(), hf_model.state_dict(), {"kernels": kernels}
        )
