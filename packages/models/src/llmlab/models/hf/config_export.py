"""llmlab config -> HF ``config.json``: the simplest ``transformers`` class that computes
exactly what the llmlab model does, or a refusal naming why none can.

:func:`to_hf_config` is what ``save_pretrained`` writes; import it from
:mod:`llmlab.models.hf.configs` (the reading direction lives there).
"""

from __future__ import annotations

from typing import Any

from llmlab.models.gpt_config import GPTConfig
from llmlab.models.hf.config_fields import ARCHITECTURES, MOE_FAMILY
from llmlab.models.llama_config import LlamaConfig


# --------------------------------------------------------------------------- llmlab -> HF
def to_hf_config(config: GPTConfig | LlamaConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``transformers``' class that computes what ``config`` does."""
    if isinstance(config, GPTConfig):
        return _gpt2_out(config, dtype)
    return _llama_out(config, dtype)


def _gpt2_out(c: GPTConfig, dtype: str) -> dict[str, Any]:
    if not c.bias:
        raise ValueError("GPTConfig(bias=False) has no transformers counterpart (GPT-2 has biases)")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "layer_norm_epsilon": c.layer_norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": dtype,
    }


def _moe_family_out(c: LlamaConfig) -> str:
    """The ``transformers`` MoE family that computes ``c``, or a refusal naming why none does."""
    why = None
    if c.router_scoring != "softmax" or c.n_group != 1:
        why = (
            "sigmoid / group-limited routing is DeepSeek-V3's, whose transformers class also "
            "needs multi-head latent attention (kv_lora_rank), which this model does not have"
        )
    elif c.capacity_factor is not None:
        why = f"capacity_factor={c.capacity_factor} drops tokens, which no transformers MoE does"
    elif c.routed_scaling_factor != 1.0:
        why = f"routed_scaling_factor={c.routed_scaling_factor} (Mixtral / Qwen-MoE have none)"
    elif c.shared_expert_intermediate_size and not c.shared_expert_gate:
        why = "an ungated shared expert (Qwen2-MoE gates it; DeepSeek's needs MLA)"
    elif c.shared_expert_intermediate_size and c.qk_norm:
        why = "a shared expert with q/k norms (Qwen2-MoE has no q/k norms, Qwen3-MoE no shared "
        why += "expert)"
    elif c.window_layers is not None or (c.sliding_window is not None and c.qk_norm):
        why = "per-layer sliding windows in a mixture of experts"
    if why is None and c.shared_expert_intermediate_size:
        if c.attention_out_bias or c.sliding_window is not None:
            why = "Qwen2-MoE has no bias on o_proj and no sliding window here"
        else:
            return "qwen2_moe"
    if why is None and c.qk_norm:
        if c.attention_bias != c.attention_out_bias:
            why = "Qwen3-MoE has one switch for the q, k, v and o biases"
        else:
            return "qwen3_moe"
    if why is None:
        if (
            not c.norm_topk_prob
            or c.moe_layers is not None
            or c.attention_bias
            or (c.attention_out_bias)
        ):
            why = (
                "without q/k norms or a shared expert this is Mixtral's layout, which "
                "renormalises the top-k weights, puts experts in every layer and has no "
                "attention biases"
            )
        else:
            return "mixtral"
    raise ValueError(f"this mixture of experts has no transformers counterpart: {why}")


def _deepseek_family_out(c: LlamaConfig) -> str:
    """``deepseek_v3`` for a latent-attention model its class computes, or a refusal saying
    why not (dense layers first, then DeepSeek's MoE in every later layer)."""
    why = None
    moe = [i for i in range(c.n_layer) if c.is_moe_layer(i)]
    width = c.moe_intermediate_size or c.intermediate_size
    if c.num_experts and c.router_scoring != "sigmoid":
        why = "DeepSeek-V3 routes by sigmoid scores (router_scoring='sigmoid')"
    elif c.num_experts and moe != list(range(c.n_layer - len(moe), c.n_layer)):
        why = f"MoE layers {moe}: DeepSeek-V3 has dense layers first, then experts in every layer"
    elif c.num_experts and c.capacity_factor is not None:
        why = f"capacity_factor={c.capacity_factor} drops tokens, which no transformers MoE does"
    elif c.num_experts and (c.shared_expert_gate or c.shared_expert_intermediate_size % width):
        why = (
            "DeepSeek-V3's shared experts are ungated and n_shared_experts · "
            f"moe_intermediate_size wide (shared_expert_intermediate_size="
            f"{c.shared_expert_intermediate_size}, moe_intermediate_size={width})"
        )
    if why is not None:
        raise ValueError(f"this latent-attention model has no transformers counterpart: {why}")
    return "deepseek_v3"


def _llama_family_out(c: LlamaConfig) -> str:
    """The simplest family that expresses ``c`` exactly (module docstring)."""
    if c.latent_attention:
        return _deepseek_family_out(c)
    if c.rope_interleave:
        raise ValueError(
            "rope_interleave without latent attention has no transformers counterpart here "
            "(only DeepseekV3ForCausalLM interleaves RoPE pairs)"
        )
    if c.num_experts:
        return _moe_family_out(c)
    qwen2_bias = c.attention_bias and not c.attention_out_bias  # Qwen2: q, k, v only
    if c.qk_norm:
        family = "qwen3"
    elif qwen2_bias or c.window_layers is not None:
        family = "qwen2"
    elif c.sliding_window is not None:
        family = "mistral"
    else:
        family = "llama"
    if family == "qwen2" and not qwen2_bias:
        raise ValueError(
            "per-layer sliding windows (window_layers) without q/k norms are Qwen2's, which "
            "biases q, k, v and not o; this model's biases differ, so no transformers class "
            "computes it"
        )
    if family == "mistral" and c.attention_bias:
        raise ValueError("a sliding window with attention biases has no transformers counterpart")
    if family in ("llama", "qwen3") and c.attention_bias != c.attention_out_bias:
        raise ValueError(
            f"attention_bias={c.attention_bias} with attention_out_bias={c.attention_out_bias} "
            f"has no transformers counterpart ({family}: one switch for q, k, v and o)"
        )
    return family


def _llama_out(c: LlamaConfig, dtype: str) -> dict[str, Any]:
    family = _llama_family_out(c)
    if family == "deepseek_v3":
        return _deepseek_out(c, dtype)
    out: dict[str, Any] = {
        "architectures": [next(a for a, f in ARCHITECTURES.items() if f == family)],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_size,
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": dtype,
    }
    if family in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = c.attention_bias
    if family == "llama":
        out["mlp_bias"] = False
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = c.sliding_window
    if family in MOE_FAMILY:
        out.update(_moe_out(c, family))
    if family in ("qwen2", "qwen3"):  # (the MoE families refuse windows above)
        windowed = [i for i in range(c.n_layer) if c.layer_window(i) is not None]
        first = windowed[0] if windowed else c.n_layer
        if windowed and windowed != list(range(first, c.n_layer)):
            raise ValueError(
                f"window_layers={c.window_layers}: Qwen windows the last layers only "
                "(max_window_layers); no transformers class windows these"
            )
        out["use_sliding_window"] = bool(windowed)
        out["sliding_window"] = c.sliding_window
        out["max_window_layers"] = first
        out["layer_types"] = [
            "sliding_attention" if i >= first else "full_attention" for i in range(c.n_layer)
        ]
    return out


def _moe_out(c: LlamaConfig, family: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_experts_per_tok": c.num_experts_per_tok,
        "router_aux_loss_coef": c.router_aux_loss_coef,
    }
    width = c.moe_intermediate_size or c.intermediate_size
    if family == "mixtral":
        return {
            **out,
            "num_local_experts": c.num_experts,
            "intermediate_size": width,
            "router_jitter_noise": 0.0,
        }
    moe = [i for i in range(c.n_layer) if c.is_moe_layer(i)]
    out.update(
        num_experts=c.num_experts,
        moe_intermediate_size=width,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.n_layer) if i not in moe],
        use_sliding_window=False,
        sliding_window=None,
    )
    if family == "qwen2_moe":
        out.update(
            shared_expert_intermediate_size=c.shared_expert_intermediate_size,
            qkv_bias=c.attention_bias,
        )
    return out


def _deepseek_out(c: LlamaConfig, dtype: str) -> dict[str, Any]:
    moe = [i for i in range(c.n_layer) if c.is_moe_layer(i)]
    width = c.moe_intermediate_size or c.intermediate_size
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head,
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "rope_interleave": c.rope_interleave,
        "hidden_act": "silu",
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        # no MoE layer: every layer dense (first_k_dense_replace = all); the routing fields
        # then describe no module
        "first_k_dense_replace": c.n_layer - len(moe),
        "n_routed_experts": c.num_experts or 1,
        "num_experts_per_tok": c.num_experts_per_tok if c.num_experts else 1,
        "moe_intermediate_size": width,
        "n_shared_experts": c.shared_expert_intermediate_size // width if c.num_experts else 0,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "routed_scaling_factor": c.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
        "torch_dtype": dtype,
    }
    return out
