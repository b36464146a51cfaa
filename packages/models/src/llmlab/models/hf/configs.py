"""``config.json`` <-> llmlab config: every field is translated, checked or refused by name.

A field of an HF config is one of three things here:

* **translated** into an llmlab config field (``hidden_size`` -> ``n_embd``, ``rope_scaling`` ->
  ``rope_scaling``, ``layer_types`` -> ``window_layers``, ...);
* **required** to hold the value llmlab implements (``hidden_act`` must be ``silu``,
  ``mlp_bias`` false, ``attention_dropout`` 0): any other value is refused, naming it;
* **inert metadata** that changes neither the function the weights compute nor how they train
  (token ids, ``torch_dtype``, ``initializer_range`` -- weights are loaded, not initialised --,
  ``use_cache``, generation defaults, ``pretraining_tp``: Meta's matmul split, the same maths).

Anything else -- a field of a newer or different architecture -- is refused by name, so a
checkpoint is never loaded approximately. The inverse, :func:`to_hf_config`, picks the simplest
``transformers`` class that computes exactly what the llmlab model does, and refuses a model
none of them can express.
"""

from __future__ import annotations

from typing import Any

from llmlab.models.gpt_config import GPTConfig
from llmlab.models.hf.folder import CheckpointError
from llmlab.models.llama_config import LlamaConfig

ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILY, "deepseek_v3")
# Families refused with what is missing, rather than "not supported".
NOT_YET: dict[str, str] = {}

INERT = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "tokenizer_class", "id2label",
    "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "chunk_size_feed_forward", "tie_encoder_decoder", "is_decoder", "cross_attention_hidden_size",
    "pruned_heads", "_attn_implementation_autoset", "use_return_dict",
    # generation defaults that old transformers versions wrote into config.json
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss", "output_router_logits",
})  # fmt: skip
# "pretraining_tp": Llama 2's tensor-parallel degree at pre-training; transformers >= 4.4x
# ignores it and older versions only split the same matmuls into slices (same maths).
# GPT-2's summary_* fields configure the sequence-summary head of GPT2DoubleHeadsModel /
# GPT2ForSequenceClassification, which a causal LM does not have; n_ctx is GPT-2's old name
# for n_positions, unused by the model.
FAMILY_INERT = {
    "llama": {"pretraining_tp"},
    # the multi-token-prediction modules (num_nextn_predict_layers, transformers' num_mtp_layers)
    # are not part of the causal LM transformers runs; expert-parallel size and the training-only
    # sequence-wise balance loss change neither the function nor what is loaded
    "deepseek_v3": {
        "pretraining_tp", "num_nextn_predict_layers", "num_mtp_layers", "ep_size",
        "aux_loss_alpha", "seq_aux",
    },
    "gpt2": {
        "n_ctx", "summary_type", "summary_use_proj", "summary_activation",
        "summary_proj_to_labels", "summary_first_dropout",
    },
}  # fmt: skip
REQUIRED: dict[str, Any] = {
    "is_encoder_decoder": False,
    "add_cross_attention": False,
    "hidden_act": "silu",
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
    "use_mrope": False,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "router_jitter_noise": 0.0,  # Mixtral's multiplicative noise on the router input in training
}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both tanh-approximated GELU
LLAMA_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types",
}  # fmt: skip
MOE_KEYS = {
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "router_aux_loss_coef", "qkv_bias",
}  # fmt: skip
DEEPSEEK_KEYS = {
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "rope_interleave",
}  # fmt: skip
# DeepSeek's own config.json (trust_remote_code) spells the routing it implements; only these
# values are the function transformers' class computes.
DEEPSEEK_REQUIRED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
GPT2_KEYS = {
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "tie_word_embeddings",
}  # fmt: skip


def family_of(hf: dict[str, Any], where: str) -> str:
    """``model_type`` checked against ``architectures``: the family llmlab will build."""
    model_type = hf.get("model_type")
    if model_type in NOT_YET:
        raise CheckpointError(f"{where}: model_type={model_type!r} is not supported yet: "
                              f"{NOT_YET[model_type]}")  # fmt: skip
    if model_type not in (*LLAMA_FAMILY, "gpt2"):
        raise CheckpointError(
            f"{where}: model_type={model_type!r} is not supported; supported: "
            f"{', '.join((*LLAMA_FAMILY, 'gpt2'))}"
        )
    for arch in hf.get("architectures") or []:
        if ARCHITECTURES.get(arch) != model_type:
            raise CheckpointError(
                f"{where}: architectures={hf['architectures']} with model_type={model_type!r}: "
                f"only the causal-LM head is supported ({', '.join(ARCHITECTURES)})"
            )
    return model_type


def check_fields(hf: dict[str, Any], family: str, where: str) -> None:
    """Refuse any field that is neither translated, inert, nor at its required value."""
    translated = GPT2_KEYS if family == "gpt2" else LLAMA_KEYS
    if family in MOE_FAMILY:
        translated = LLAMA_KEYS | MOE_KEYS
    required = REQUIRED
    if family == "deepseek_v3":
        translated = LLAMA_KEYS | DEEPSEEK_KEYS
        required = {**REQUIRED, **DEEPSEEK_REQUIRED}
    for key, value in hf.items():
        if key in required:
            if value != required[key] and value is not None:
                raise CheckpointError(
                    f"{where}: {key}={value!r} is not supported (llmlab implements "
                    f"{key}={required[key]!r})"
                )
        elif key not in translated and key not in INERT and key not in FAMILY_INERT.get(family, ()):
            raise CheckpointError(
                f"{where}: field {key!r} (= {_short(value)}) is not implemented for "
                f"model_type={family!r}; refusing to load the model approximately"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- HF -> llmlab
def from_hf_config(hf: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """``(arch, llmlab config fields)`` for an HF ``config.json`` (``where`` names it)."""
    family = family_of(hf, where)
    check_fields(hf, family, where)
    if family == "gpt2":
        return "gpt", _gpt2(hf, where)
    return "llama", _llama(hf, family, where)


def _gpt2(hf: dict[str, Any], where: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise CheckpointError(
            f"{where}: activation_function={act!r} is not supported (tanh GELU: "
            f"{', '.join(GPT2_ACTIVATIONS)})"
        )
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise CheckpointError(
            f"{where}: n_inner={hf['n_inner']} is not supported (llmlab's GPT MLP is 4 · n_embd "
            f"= {4 * n_embd} wide)"
        )
    drops = {k: hf.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        raise CheckpointError(
            f"{where}: dropouts {drops} differ; llmlab's GPT has one dropout for embeddings, "
            "attention and residuals"
        )
    return {
        "vocab_size": hf.get("vocab_size", 50257),
        "block_size": hf.get("n_positions", 1024),
        "n_layer": hf.get("n_layer", 12),
        "n_head": hf.get("n_head", 12),
        "n_embd": n_embd,
        "dropout": float(drops["resid_pdrop"]),
        "bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
    }


def _rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (earlier); HF's spelling ``type`` is read as ``rope_type``."""
    params = _rope_spelling(hf.get("rope_parameters"))
    scaling = _rope_spelling(hf.get("rope_scaling"))
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    if params and scaling and params != scaling:
        raise CheckpointError(
            f"{where}: rope_parameters={hf['rope_parameters']} and rope_scaling="
            f"{hf['rope_scaling']} disagree; keep one"
        )
    merged = params or scaling
    kind = merged.get("rope_type", "default")
    if kind == "default":
        extra = sorted(set(merged) - {"rope_type"})
        if extra:
            raise CheckpointError(f"{where}: rope parameter {extra[0]!r} is not supported")
        return float(theta), None
    if kind in ("llama3", "yarn"):  # as transformers' standardize_rope_params fills it in
        merged.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if kind == "yarn":
        merged = {k: v for k, v in merged.items() if v is not None}  # None: HF's default
        if "factor" not in merged:  # transformers: the ratio of the two context lengths
            merged["factor"] = (
                hf["max_position_embeddings"] / merged["original_max_position_embeddings"]
            )
    return float(theta), merged


def _rope_spelling(raw: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(raw or {})
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    return out


def _windows(hf: dict[str, Any], family: str, layers: int, where: str) -> tuple[Any, Any]:
    """(sliding_window, window_layers) as transformers resolves them for each family."""
    window = hf.get("sliding_window")
    if family.startswith("qwen") and not hf.get("use_sliding_window", False):
        window = None  # Qwen keeps the number but applies it only with use_sliding_window
    if window is None:
        return None, None
    if family in ("qwen2_moe", "qwen3_moe"):
        raise CheckpointError(
            f"{where}: use_sliding_window with model_type={family!r} is not supported (its "
            "windowed layers follow another rule than Qwen2's; not implemented)"
        )
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown or len(types) != layers:
            raise CheckpointError(f"{where}: layer_types={types} is not supported")
        windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif family in ("qwen2", "qwen3"):
        windowed = list(range(hf.get("max_window_layers", layers), layers))
    else:
        windowed = list(range(layers))
    if not windowed:
        return None, None
    return int(window), None if len(windowed) == layers else windowed


def _llama(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    width = hf["hidden_size"]
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim")
    theta, scaling = _rope(hf, where)
    window, window_layers = _windows(hf, family, layers, where)
    if family == "deepseek_v3":
        head_dim = None  # transformers writes qk_rope_head_dim there; latent attention's own
    bias = bool(hf.get("attention_bias", False))
    qkv_bias = family == "qwen2" or (family == "qwen2_moe" and hf.get("qkv_bias", True))
    out = {
        "vocab_size": hf["vocab_size"],
        "block_size": hf.get("max_position_embeddings", 2048),
        "n_layer": layers,
        "n_head": heads,
        "n_kv_head": hf.get("num_key_value_heads") or heads,
        "n_embd": width,
        "intermediate_size": hf["intermediate_size"],
        "head_dim": None if head_dim in (None, width // heads) else int(head_dim),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": qkv_bias if family in ("qwen2", "qwen2_moe") else bias,
        "attention_out_bias": False if family in ("qwen2", "qwen2_moe") else bias,
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "sliding_window": window,
        "window_layers": window_layers,
    }
    if family in MOE_FAMILY:
        out.update(_moe(hf, family, layers, where))
    if family == "deepseek_v3":
        out.update(_deepseek(hf, layers, where))
    return out


def _deepseek(hf: dict[str, Any], layers: int, where: str) -> dict[str, Any]:
    """DeepSeek-V3: multi-head latent attention with (by default) interleaved RoPE; dense MLPs
    in the first ``first_k_dense_replace`` layers, then DeepSeek's MoE: sigmoid router with the
    ``e_score_correction_bias`` selection bias, group-limited top-k, ``routed_scaling_factor``
    and ``n_shared_experts`` ungated shared experts (one MLP of their summed width)."""
    rope, nope = int(hf.get("qk_rope_head_dim", 64)), int(hf.get("qk_nope_head_dim", 128))
    for key, want in (("head_dim", rope), ("qk_head_dim", rope + nope)):
        if hf.get(key) not in (None, want):
            raise CheckpointError(
                f"{where}: {key}={hf[key]} disagrees with qk_rope_head_dim={rope} and "
                f"qk_nope_head_dim={nope} (transformers derives {key}={want})"
            )
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise CheckpointError(
            f"{where}: num_key_value_heads={hf['num_key_value_heads']} with num_attention_heads="
            f"{heads}: latent attention gives every head its own key and value"
        )
    q_lora = hf.get("q_lora_rank", 1536)
    fields: dict[str, Any] = {
        "n_kv_head": heads,
        "kv_lora_rank": int(hf.get("kv_lora_rank", 512)),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(hf.get("v_head_dim") or 128),
        "rope_interleave": bool(hf.get("rope_interleave", True)),
    }
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    if not experts or first_dense >= layers:
        return {**fields, "num_experts": 0}  # transformers builds every layer dense
    width = int(hf.get("moe_intermediate_size", 2048))
    fields.update(
        num_experts=experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 8),
        moe_intermediate_size=width,
        moe_layers=None if first_dense == 0 else list(range(first_dense, layers)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=width * int(hf.get("n_shared_experts") or 0),
    )
    return fields


def _moe(hf: dict[str, Any], family: str, layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields: Mixtral (every layer, renormalised top-k, experts as
    wide as ``intermediate_size``) or Qwen2/3-MoE (``moe_intermediate_size``; the MoE layers by
    ``decoder_sparse_step`` and ``mlp_only_layers``; Qwen2-MoE's gated shared expert)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    fields: dict[str, Any] = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
    }
    if family == "mixtral":
        return {**fields, "norm_topk_prob": True}
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not experts or not moe:
        return {"num_experts": 0}  # transformers builds every layer dense
    fields.update(
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        moe_layers=None if len(moe) == layers else moe,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    if family == "qwen2_moe":
        width = int(hf.get("shared_expert_intermediate_size") or 0)
        if not width:
            raise CheckpointError(
                f"{where}: shared_expert_intermediate_size={width}: Qwen2-MoE without a shared "
                "expert is not supported"
            )
        fields.update(shared_expert_intermediate_size=width, shared_expert_gate=True)
    return fields


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
        return {**out, "num_local_experts": c.num_experts, "intermediate_size": width,
                "router_jitter_noise": 0.0}  # fmt: skip
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
        out.update(shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                   qkv_bias=c.attention_bias)  # fmt: skip
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
