"""A Llama-family decoder (Llama, Mistral, Qwen2), plain PyTorch, beside the GPT and with its doors.

What differs from GPT-2, block by block: rotary position embeddings (RoPE) on q and k instead
of a learned position table; RMSNorm instead of LayerNorm; a gated SwiGLU MLP
``down(silu(gate(x)) * up(x))`` instead of GELU; grouped-query attention (GQA): ``n_kv_head``
key/value heads, each shared by ``n_head / n_kv_head`` query heads; no biases (except Qwen2's on
q, k, v); an untied LM head by default.

The contracts of DESIGN §3 are the GPT's, met the same way:

* **Pipeline**: ``pipeline_layers()`` is ``[embed, *blocks, head]``; a block called with the
  hidden state alone takes positions ``0..T-1`` (training), so RoPE needs nothing passed between
  stages.
* **Tensor parallel**: ``tensor_parallel_plan()`` shards q by heads, k and v by KV heads (so
  ``tensor_parallel_divisors()`` includes ``n_kv_head``), gate and up column-wise, down and o
  row-wise. Separate q/k/v projections make every contiguous column shard hold whole heads, and a
  rank's query heads ``[r·H/tp, (r+1)·H/tp)`` read exactly its KV heads ``[r·H_kv/tp, ...)``.
  Attention takes its local head counts from its (possibly sharded) projections, never the config.
* **Decoding**: ``forward(input_ids, cache=None, positions=None, attention_mask=None,
  logits_to_keep=0)`` with a ``KVCache`` from ``new_cache`` that stores only the KV heads: a
  GQA model's cache is ``n_kv_head / n_head`` of a multi-head one's. Positions follow the
  attention mask into the RoPE angles, so left-padded rows decode like unpadded ones.

RoPE uses HF's "rotate half" pairs ``(x_i, x_{i+D/2})`` (see ``llmlab.kernels.rope``), and the
layer layout mirrors ``transformers``' ``LlamaForCausalLM``, so ``Llama.from_hf`` is a renaming
and logits match it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.models.kv_cache import KVCache
from llmlab.models.masks import attention_bias, resolve_positions
from llmlab.models.ops import Ops, get_ops

if TYPE_CHECKING:  # transformers is an optional, test-time dependency
    from transformers import PreTrainedModel

KERNEL_BACKENDS = ("torch", "triton")


@dataclass
class LlamaConfig:
    """Hyper-parameters of the Llama. ``validate()`` is called on construction of a ``Llama``."""

    vocab_size: int = 256
    block_size: int = 256  # the longest sequence (prompt + generated) the model is used for
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # key/value heads; == n_head is multi-head attention, 1 is multi-query
    n_embd: int = 128
    intermediate_size: int = 384  # the gated MLP's width (Llama: about 8/3 · n_embd)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    attention_out_bias: bool = False  # bias on the output projection (HF Llama's attention_bias)
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    kernels: str = "torch"  # "torch" (PyTorch ops) or "triton" (llmlab.kernels)

    def validate(self) -> None:
        """Fail early, naming the bad value and what would be valid."""
        for name in (
            "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
            "intermediate_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]
            near = sorted(divisors, key=lambda h: abs(h - self.n_head))[:4]
            raise ValueError(
                f"LlamaConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"valid n_head values near it: {sorted(near)}"
            )
        if self.n_head % self.n_kv_head != 0:
            valid = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"LlamaConfig.n_head={self.n_head} is not divisible by n_kv_head="
                f"{self.n_kv_head} (each KV head serves a whole group of query heads); "
                f"valid n_kv_head: {valid}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.n_embd={self.n_embd} / n_head={self.n_head} = {self.head_dim}, "
                "the head dim, must be even (RoPE rotates dimensions in pairs)"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(
                f"LlamaConfig.kernels={self.kernels!r} is not one of {list(KERNEL_BACKENDS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Rotary:
    """cos and sin of the RoPE angles ``position · θ^(-2i/D)``, i < D/2, computed as HF does.

    Not an ``nn.Module`` on purpose: the inverse frequencies must stay fp32 when the model is
    cast to fp16/bf16 (``model.half()`` would round a buffer), so they live in a per-device cache
    that ``.to()`` never touches. The angles are recomputed per call from the positions: a
    (B or 1, T, D/2) product, negligible next to the projections.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device)
            self._inv_freq[device] = 1.0 / (self.theta ** (exponents / self.head_dim))
        return self._inv_freq[device]

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) of shape (positions.shape[0], T, D/2), in ``dtype`` (as HF casts them)."""
        angles = positions[..., None].float() * self.inv_freq(positions.device)
        return angles.cos().to(dtype), angles.sin().to(dtype)


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
    """Causal grouped-query attention with RoPE; separate q, k, v projections (head-major rows)."""

    def __init__(self, config: LlamaConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        C, D = config.n_embd, config.head_dim
        self.head_dim = D
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(C, config.n_head * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(C, config.n_kv_head * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(C, config.n_kv_head * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.n_head * D, C, bias=config.attention_out_bias)
        self.rotary = Rotary(D, config.rope_theta)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    @property
    def local_heads(self) -> int:
        """Query heads held here: all of them, or this rank's share once q_proj is sharded."""
        return self.q_proj.weight.shape[0] // self.head_dim

    @property
    def local_kv_heads(self) -> int:
        """Key/value heads held here (what the KV cache stores)."""
        return self.k_proj.weight.shape[0] // self.head_dim

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = True,
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
        if positions is None:  # a block run on its own (a pipeline stage): a fresh sequence
            positions = torch.arange(T, device=x.device).unsqueeze(0)
        cos, sin = self.rotary(positions, q.dtype)
        q, k = self.ops.rope(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is None and causal:
            docs = {} if document_ids is None else {"document_ids": document_ids}
            y = self.ops.attention(q, k, v, causal=True, dropout_p=dropout_p, **docs)
        else:  # decoding: an explicit mask, or one new token that may see every cached key
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, enable_gqa=True
            )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, ops: Ops) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: LlamaConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.rms_norm_eps, ops)
        self.attn = Attention(config, layer_idx, ops)
        self.mlp_norm = RMSNorm(config.n_embd, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = True,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        # ids by keyword: sequence parallelism gathers only the first positional input
        h = self.attn_norm(x)
        x = x + self.attn(h, positions, cache, attn_mask, causal, document_ids=document_ids)
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
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


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
            if name.endswith(("o_proj.weight", "down_proj.weight")):
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
        logits_to_keep: int = 0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits for ``input_ids`` (B, T).

        ``cache``: a ``KVCache`` from ``new_cache``; the new tokens are appended to it.
        ``attention_mask``: (B, past + T) with 1 for real tokens and 0 for (left) padding.
        ``positions``: (B, T) position ids, the RoPE angles' positions; by default derived from
        the mask (or the cache). ``logits_to_keep``: if > 0, only the last that many positions
        go through the LM head. ``document_ids``: (B, T) ids of the packed documents,
        non-decreasing per row (training): attention stays inside each document and the RoPE
        positions restart at each document's start.
        """
        past = cache.length if cache is not None else 0
        T = input_ids.shape[1]
        if past + T > self.config.block_size:
            raise ValueError(
                f"{past + T} tokens (cached {past} + new {T}) exceed the model's block_size "
                f"{self.config.block_size}; sequences may hold at most "
                f"{self.config.block_size} tokens"
            )
        positions = resolve_positions(
            input_ids, positions, past, attention_mask, document_ids, cache is not None
        )
        # Without padding, a fresh sequence is plainly causal and a single new token may attend to
        # every cached key: neither needs a mask tensor, so the fused causal kernel stays in use.
        attn_mask = None
        if attention_mask is not None or (past > 0 and T > 1):
            attn_mask = attention_bias(input_ids, past, attention_mask)
        causal = past == 0
        x = self.embed(input_ids)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        for block in self.blocks:
            x = block(x, positions, cache, attn_mask, causal, **docs)
        if cache is not None:
            cache.advance(T)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return self.head(x)

    # ----------------------------------------------------------------------- contracts
    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A preallocated cache of the *KV* heads only: ``n_kv_head / n_head`` of an MHA cache."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={self.config.block_size}"
            )
        ref = self.embed.tokens.weight
        heads = self.blocks[0].attn.local_kv_heads if len(self.blocks) else self.config.n_kv_head
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
        """Replace each block's attention function ``fn`` by ``wrap(fn)``; returns the count.

        The function receives GQA's shapes: q (B, H, T, D), k and v (B, H_kv, T, D).
        """
        for block in self.blocks:
            attn = block.attn
            attn.ops = replace(attn.ops, attention=wrap(attn.ops.attention))
        return len(self.blocks)

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """Sizes a tensor-parallel degree must divide: whole query and KV heads, the MLP width,
        the hidden size and the vocabulary."""
        c = self.config
        return {
            "n_head": c.n_head,
            "n_kv_head": c.n_kv_head,
            "n_embd": c.n_embd,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
        }

    @staticmethod
    def tensor_parallel_plan() -> dict[str, str]:
        """Which modules to shard and how (Megatron-LM's layout; see llmlab.parallel.tensor)."""
        return {
            "embed.tokens": "vocab",
            "blocks.*.attn.q_proj": "colwise",  # by query heads
            "blocks.*.attn.k_proj": "colwise",  # by KV heads
            "blocks.*.attn.v_proj": "colwise",
            "blocks.*.attn.o_proj": "rowwise",
            "blocks.*.mlp.gate_proj": "colwise",
            "blocks.*.mlp.up_proj": "colwise",
            "blocks.*.mlp.down_proj": "rowwise",
            "head.lm_head": "vocab",
        }

    # ------------------------------------------------------------------------ metrics
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the input embedding table is excluded by default (a lookup costs no
        matmul) unless it is tied to the LM head, which does."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.embed.tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·H·D·T.

        GQA shrinks N (smaller k/v projections) but not the attention term: every query head
        still scores every key.
        """
        c = self.config
        T = seq_len or c.block_size
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_head * c.head_dim * T

    # ------------------------------------------------------------------- conversions
    @classmethod
    def from_hf(cls, hf_model: PreTrainedModel, kernels: str = "torch") -> Llama:
        """An llmlab Llama with the config and weights of a HF ``LlamaForCausalLM`` (or a
        Mistral / Qwen2 causal LM: the same architecture up to attention biases and windows).

        Refused, with the value named: activations other than SiLU, an explicit ``head_dim``
        other than ``hidden_size / heads``, RoPE scaling (``rope_type`` other than default), MLP
        biases. A sliding attention window ``W`` is exact for sequences of at most ``W`` tokens,
        so ``block_size`` becomes ``min(max_position_embeddings, W)``.
        """
        hf = hf_model.config
        sd = hf_model.state_dict()
        name = type(hf_model).__name__
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"Llama.from_hf({name}): hidden_act={hf.hidden_act!r}; only 'silu'")
        heads, width = hf.num_attention_heads, hf.hidden_size
        head_dim = getattr(hf, "head_dim", None) or width // heads
        if head_dim * heads != width:
            raise ValueError(
                f"Llama.from_hf({name}): head_dim={head_dim} but hidden_size / heads = "
                f"{width} / {heads}; only head_dim = hidden_size / num_attention_heads is supported"
            )
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"Llama.from_hf({name}): rope_type={rope_type!r} is not supported")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        if "model.layers.0.mlp.gate_proj.bias" in sd:
            raise ValueError(f"Llama.from_hf({name}): MLP biases (mlp_bias=True) are not supported")
        block_size = hf.max_position_embeddings
        windows = [getattr(hf, "sliding_window", None)] if _uses_sliding_window(hf) else []
        block_size = min([block_size, *[w for w in windows if w]])
        config = LlamaConfig(
            vocab_size=hf.vocab_size,
            block_size=block_size,
            n_layer=hf.num_hidden_layers,
            n_head=heads,
            n_kv_head=getattr(hf, "num_key_value_heads", None) or heads,
            n_embd=width,
            intermediate_size=hf.intermediate_size,
            rope_theta=float(theta),
            rms_norm_eps=hf.rms_norm_eps,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias="model.layers.0.self_attn.q_proj.bias" in sd,
            attention_out_bias="model.layers.0.self_attn.o_proj.bias" in sd,
            dropout=0.0,
            kernels=kernels,
        )
        model = cls(config)
        ours: dict[str, Tensor] = {
            "embed.tokens.weight": sd["model.embed_tokens.weight"],
            "head.norm.weight": sd["model.norm.weight"],
            "head.lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
        }
        renames = {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "mlp_norm",
            **{f"self_attn.{p}": f"attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{f"mlp.{p}": f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
        }
        for i in range(config.n_layer):
            for src, dst in renames.items():
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.{src}.{kind}"
                    if key in sd:
                        ours[f"blocks.{i}.{dst}.{kind}"] = sd[key]
        model.load_state_dict({k: v.detach().clone() for k, v in ours.items()})
        return model.to(dtype=next(hf_model.parameters()).dtype)


def _uses_sliding_window(hf_config: Any) -> bool:
    """Mistral windows every layer when ``sliding_window`` is set; Qwen2 marks windowed layers
    in ``layer_types``."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(hf_config, "sliding_window", None) is not None
