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
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")

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
}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both tanh-approximated GELU
LLAMA_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types",
}  # fmt: skip
GPT2_KEYS = {
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "tie_word_embeddings",
}  # fmt: skip


def family_of(hf: dict[str, Any], where: str) -> str:
    """``model_type`` checked against ``architectures``: the family llmlab will build."""
    model_type = hf.get("model_type")
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
    for key, value in hf.items():
        if key in REQUIRED:
            if value != REQUIRED[key] and value is not None:
                raise CheckpointError(
                    f"{where}: {key}={value!r} is not supported (llmlab implements "
                    f"{key}={REQUIRED[key]!r})"
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
    if merged.get("rope_type", "default") == "default":
        extra = sorted(set(merged) - {"rope_type"})
        if extra:
            raise CheckpointError(f"{where}: rope parameter {extra[0]!r} is not supported")
        return float(theta), None
    return float(theta), merged


def _rope_spelling(raw: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(raw or {})
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    return out


def _windows(hf: dict[str, Any], family: str, layers: int, where: str) -> tuple[Any, Any]:
    """(sliding_window, window_layers) as transformers resolves them for each family."""
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None  # Qwen keeps the number but applies it only with use_sliding_window
    if window is None:
        return None, None
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
    bias = bool(hf.get("attention_bias", False))
    return {
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
        "attention_bias": True if family == "qwen2" else bias,
        "attention_out_bias": False if family == "qwen2" else bias,
        "qk_norm": family == "qwen3",
        "sliding_window": window,
        "window_layers": window_layers,
    }


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


def _llama_family_out(c: LlamaConfig) -> str:
    """The simplest family that expresses ``c`` exactly (module docstring)."""
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
    if family in ("llama", "qwen3"):
        out["attention_bias"] = c.attention_bias
    if family == "llama":
        out["mlp_bias"] = False
    if family == "mistral":
        out["sliding_window"] = c.sliding_window
    if family in ("qwen2", "qwen3"):
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
