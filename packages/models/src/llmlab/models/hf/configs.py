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

The field tables live in :mod:`llmlab.models.hf.config_fields`, the llmlab -> HF direction in
:mod:`llmlab.models.hf.config_export` (re-exported here); this module reads and checks.
"""

from __future__ import annotations

from typing import Any

from llmlab.models.hf.config_export import to_hf_config
from llmlab.models.hf.config_fields import (
    ARCHITECTURES,
    DEEPSEEK_KEYS,
    DEEPSEEK_REQUIRED,
    FAMILY_INERT,
    GPT2_ACTIVATIONS,
    GPT2_KEYS,
    INERT,
    LLAMA_FAMILY,
    LLAMA_KEYS,
    MOE_FAMILY,
    MOE_KEYS,
    NOT_YET,
    REQUIRED,
)
from llmlab.models.hf.folder import CheckpointError

__all__ = ["check_fields", "family_of", "from_hf_config", "to_hf_config"]


def family_of(hf: dict[str, Any], where: str) -> str:
    """``model_type`` checked against ``architectures``: the family llmlab will build."""
    model_type = hf.get("model_type")
    if model_type in NOT_YET:
        raise CheckpointError(
            f"{where}: model_type={model_type!r} is not supported yet: {NOT_YET[model_type]}"
        )
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
