"""``LlamaConfig``: the hyper-parameters of the Llama family, and the checks that name bad values.

One config covers the family members that differ only in a few switches, each named after what
it changes rather than after the model that introduced it:

* ``head_dim``: an explicit per-head width (Qwen3, Mistral v0.3, Llama 3.2 write it); ``None``
  is ``n_embd / n_head``. The projections are ``n_embd -> n_head · head_dim``, so the attention
  width may differ from the residual width.
* ``rope_scaling``: how the RoPE frequencies are rescaled for long contexts (``None``, or
  ``{"rope_type": "linear", "factor": f}``, Llama 3.1's ``{"rope_type": "llama3", ...}`` or
  YaRN's ``{"rope_type": "yarn", "factor": f, "original_max_position_embeddings": L, ...}``);
  ``rope_interleave``: RoPE pairs adjacent dimensions (DeepSeek's checkpoints); see
  :mod:`llmlab.models.rope`.
* ``kv_lora_rank`` set: multi-head latent attention (DeepSeek-V2/V3,
  :class:`llmlab.models.llama_layers.LatentAttention`) instead of grouped-query attention:
  keys and values come from a compressed latent of width ``kv_lora_rank`` (per head
  ``qk_nope_head_dim`` key and ``v_head_dim`` value dimensions) plus one decoupled RoPE key of
  ``qk_rope_head_dim`` shared by the heads; queries from a rank-``q_lora_rank`` bottleneck (or
  one projection when ``None``). ``head_dim`` and ``n_kv_head`` do not apply (``n_kv_head`` must
  equal ``n_head``).
* ``sliding_window`` with ``window_layers``: Mistral's (every layer) or Qwen2's (some layers)
  attention window of ``W`` keys: a query at position ``i`` sees keys ``(i - W, i]``.
* ``attention_bias`` (q, k, v: Qwen2) and ``attention_out_bias`` (o: HF Llama's bias).
* ``qk_norm``: an RMSNorm over each head of q and k before RoPE (Qwen3).
* ``num_experts`` > 0: the MLP of the layers in ``moe_layers`` (default: all) becomes a mixture
  of experts (:mod:`llmlab.models.moe`): ``num_experts_per_tok`` of ``num_experts`` SwiGLU
  experts of width ``moe_intermediate_size`` per token, routed by softmax (``norm_topk_prob``:
  renormalise the top-k weights, as Mixtral and Qwen3-MoE do) or by DeepSeek-V3's sigmoid
  scores (``router_scoring="sigmoid"``, ``n_group``, ``topk_group``,
  ``routed_scaling_factor``), plus an optional shared expert (Qwen2-MoE's, gated with
  ``shared_expert_gate``). ``capacity_factor`` drops (and counts) assignments over an expert's
  capacity; ``router_aux_loss_coef`` / ``router_z_loss_coef`` weigh the routing losses the
  training side adds (:meth:`llmlab.models.Llama.router_loss`); ``moe_implementation`` picks the
  grouped path or the per-expert reference loop (the same function).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmlab.models.config_checks import (
    check_dropout_and_kernels,
    check_heads_divide,
    check_positive_ints,
)
from llmlab.models.moe import MoEConfig
from llmlab.models.rope import ROPE_TYPES

LATENT_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


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
    head_dim: int | None = None  # per-head width; None: n_embd / n_head
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3" | "yarn", ...}
    rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    attention_out_bias: bool = False  # bias on the output projection (HF Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # attention window in keys; None: full causal attention
    window_layers: list[int] | None = None  # the windowed layers; None: all (with a window)
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    # "torch" (PyTorch ops), "triton" (llmlab.kernels) or "cpu" (llmlab's fused CPU SwiGLU)
    kernels: str = "torch"
    # mixture of experts (module docstring); num_experts=0: every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # each expert's width; None: intermediate_size
    moe_layers: list[int] | None = None  # the MoE layers; None: all (with num_experts > 0)
    norm_topk_prob: bool = True
    router_scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x · g) scales the shared expert
    capacity_factor: float | None = None  # None: no token is ever dropped
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in router_loss()
    router_z_loss_coef: float = 0.0  # weight of the router z-loss in router_loss()
    moe_implementation: str = "grouped"  # "grouped" or "loop" (the reference)
    # multi-head latent attention (module docstring); kv_lora_rank=None: grouped-query attention
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # None: one q projection
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def latent_attention(self) -> bool:
        """Whether the attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def head_size(self) -> int:
        """The per-head width of q and k: ``head_dim`` if given, else ``n_embd / n_head``
        (latent attention: ``qk_nope_head_dim + qk_rope_head_dim``)."""
        if self.latent_attention:
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates per head (latent attention: ``qk_rope_head_dim``)."""
        return (self.qk_rope_head_dim or 0) if self.latent_attention else self.head_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def moe_config(self) -> MoEConfig:
        """The :class:`~llmlab.models.moe.MoEConfig` of this model's MoE layers."""
        return MoEConfig(
            dim=self.n_embd,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size or self.intermediate_size,
            scoring=self.router_scoring,
            norm_topk_prob=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            shared_intermediate_size=self.shared_expert_intermediate_size,
            shared_gate=self.shared_expert_gate,
            capacity_factor=self.capacity_factor,
            implementation=self.moe_implementation,
        )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (``None``: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    def validate(self) -> None:
        """Fail early, naming the bad value and what would be valid."""
        check_positive_ints(self, (
            "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
            "intermediate_size",
        ))  # fmt: skip
        unused = [n for n in LATENT_FIELDS if getattr(self, n) is not None]
        if self.latent_attention:
            self._validate_latent_attention()
        elif unused:
            raise ValueError(
                f"LlamaConfig.{unused[0]}={getattr(self, unused[0])!r} is a latent-attention "
                "field and changes nothing without kv_lora_rank; set kv_lora_rank or drop it"
            )
        elif self.head_dim is None:
            check_heads_divide(self, " (or give head_dim explicitly)")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 2):
            raise ValueError(f"LlamaConfig.head_dim must be an integer >= 2, got {self.head_dim!r}")
        if self.n_head % self.n_kv_head != 0:
            valid = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"LlamaConfig.n_head={self.n_head} is not divisible by n_kv_head="
                f"{self.n_kv_head} (each KV head serves a whole group of query heads); "
                f"valid n_kv_head: {valid}"
            )
        if self.head_size % 2 and not self.latent_attention:  # RoPE rotates pairs
            where = (
                f"head_dim={self.head_dim}"
                if self.head_dim is not None
                else f"n_embd={self.n_embd} / n_head={self.n_head} = {self.head_size}, the "
                "head dim,"
            )
            raise ValueError(f"LlamaConfig.{where} must be even (RoPE rotates dimensions in pairs)")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        self._validate_rope_scaling()
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"LlamaConfig.sliding_window must be a positive integer or None, got "
                f"{self.sliding_window!r}"
            )
        if self.window_layers is not None:
            bad = [i for i in self.window_layers if not 0 <= i < self.n_layer]
            if self.sliding_window is None or bad:
                raise ValueError(
                    f"LlamaConfig.window_layers={self.window_layers} needs a sliding_window and "
                    f"layer indices in [0, {self.n_layer})"
                )
        check_dropout_and_kernels(self)
        self._validate_moe()

    def _validate_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"LlamaConfig.{name} must be a positive integer with latent attention "
                    f"(kv_lora_rank set), got {value!r}"
                )
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1
        ):
            raise ValueError(
                f"LlamaConfig.q_lora_rank must be a positive integer or None, got "
                f"{self.q_lora_rank!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"LlamaConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE "
                "rotates dimensions in pairs)"
            )
        clashes = {
            "n_kv_head": self.n_kv_head != self.n_head,  # every head has its own k and v
            "head_dim": self.head_dim is not None,
            "qk_norm": self.qk_norm,
            "sliding_window": self.sliding_window is not None,
            "attention_bias": self.attention_bias != self.attention_out_bias,
        }
        bad = [k for k, v in clashes.items() if v]
        if bad:
            raise ValueError(
                f"LlamaConfig: latent attention (kv_lora_rank={self.kv_lora_rank}) does not "
                f"combine with {bad[0]}={getattr(self, bad[0])!r} (it needs n_kv_head == n_head, "
                "no head_dim, qk_norm or sliding_window, and one attention_bias switch for its "
                "q_a/kv_a/o projections, as DeepSeek-V3 has)"
            )

    def _validate_moe(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(
                f"LlamaConfig.num_experts must be an integer >= 0 (0: dense), got "
                f"{self.num_experts!r}"
            )
        if self.num_experts == 0:
            if self.moe_layers is not None:
                raise ValueError(f"LlamaConfig.moe_layers={self.moe_layers} needs num_experts > 0")
            return
        if self.moe_layers is not None:
            bad = [i for i in self.moe_layers if not 0 <= i < self.n_layer]
            if bad:
                raise ValueError(
                    f"LlamaConfig.moe_layers={self.moe_layers}: layer indices must be in "
                    f"[0, {self.n_layer})"
                )
        self.moe_config().validate("LlamaConfig (num_experts_per_tok is top_k)")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LlamaConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        kind = scaling.get("rope_type")
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"LlamaConfig.rope_scaling rope_type={kind!r} is not implemented; "
                f"valid: {sorted(ROPE_TYPES)}"
            )
        required, optional = ROPE_TYPES[kind]
        expected = {"rope_type", *required}
        if not expected <= set(scaling) <= expected | set(optional):
            optional_text = f" (optional: {sorted(optional)})" if optional else ""
            raise ValueError(
                f"LlamaConfig.rope_scaling for rope_type={kind!r} needs the keys "
                f"{sorted(expected)}{optional_text}, got {sorted(scaling)}"
            )
        numbers = [k for k in (*required, *optional) if k != "truncate"]
        for key in numbers:
            if key not in required and scaling.get(key) is None:
                continue
            if not isinstance(scaling[key], int | float) or not scaling[key] > 0:
                raise ValueError(
                    f"LlamaConfig.rope_scaling[{key!r}] must be > 0, got {scaling[key]!r}"
                )
        if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(
                "LlamaConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
