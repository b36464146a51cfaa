"""The field tables of HF ``config.json`` files: which are translated, inert or required.

Data only, read by :mod:`llmlab.models.hf.configs` (HF -> llmlab, checks and refusals) and
:mod:`llmlab.models.hf.config_export` (llmlab -> HF); kept apart so the lists of what llmlab
accepts can be read, and grown, in one place.
"""

from __future__ import annotations

from typing import Any

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
        "pretraining_tp",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "ep_size",
        "aux_loss_alpha",
        "seq_aux",
    },
    "gpt2": {
        "n_ctx",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
    },
}
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
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "qkv_bias",
}
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
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layer_norm_epsilon",
    "tie_word_embeddings",
}
