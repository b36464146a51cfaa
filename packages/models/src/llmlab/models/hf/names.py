"""The name map of each family: llmlab parameter name -> :class:`Source` in the HF checkpoint.

Built from the llmlab config alone (no file read), so a caller can ask for any subset -- a
pipeline stage's layers -- before opening a single tensor. For a mixture of experts the names
of the checkpoint at hand (``present``) say which of the two layouts it uses: each expert's
tensors on their own (what ``transformers`` writes: Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's ``mlp.experts.{e}.gate_proj/up_proj/
down_proj``), or stacked (``mlp.experts.gate_up_proj`` (E, 2I, C) and ``mlp.experts.down_proj``
(E, C, I), ``transformers``' in-memory layout). Without ``present`` (saving), per expert.
"""

from __future__ import annotations

from collections.abc import Collection

from llmlab.models.gpt_config import GPTConfig
from llmlab.models.hf.weights import Source
from llmlab.models.llama_config import LlamaConfig

# Tensors an HF checkpoint may hold that are not weights: GPT-2's causal-mask buffers and the
# RoPE frequencies some older Llama checkpoints saved (recomputed from the config here).
INERT_TENSOR_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def gpt2_sources(c: GPTConfig, prefix: str = "transformer.") -> dict[str, Source]:
    """GPT-2: ``prefix`` is ``transformer.`` (GPT2LMHeadModel) or empty (GPT2Model files)."""
    src: dict[str, Source] = {
        "embed.wte.weight": Source(f"{prefix}wte.weight"),
        "embed.wpe.weight": Source(f"{prefix}wpe.weight"),
        "head.ln_f.weight": Source(f"{prefix}ln_f.weight"),
        "head.ln_f.bias": Source(f"{prefix}ln_f.bias"),
        "head.lm_head.weight": Source(
            f"{prefix}wte.weight" if c.tie_embeddings else "lm_head.weight"
        ),
    }
    heads = (c.n_head, c.head_dim)
    for i in range(c.n_layer):
        hf, ours = f"{prefix}h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            src[f"{ours}{ln}.weight"] = Source(f"{hf}{ln}.weight")
            src[f"{ours}{ln}.bias"] = Source(f"{hf}{ln}.bias")
        src[f"{ours}attn.qkv.weight"] = Source(f"{hf}attn.c_attn.weight", True, heads)
        src[f"{ours}attn.qkv.bias"] = Source(f"{hf}attn.c_attn.bias", False, heads)
        for mine, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                             ("mlp.proj", "mlp.c_proj")):  # fmt: skip
            src[f"{ours}{mine}.weight"] = Source(f"{hf}{theirs}.weight", transpose=True)
            src[f"{ours}{mine}.bias"] = Source(f"{hf}{theirs}.bias")
    return src


LLAMA_RENAMES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    **{f"attn.{p}": f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def moe_naming(c: LlamaConfig) -> str:
    """Whose per-expert names a MoE config's checkpoint uses: DeepSeek-V3's (sigmoid routing:
    ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts``), Qwen's (a shared expert or
    q/k norms: Qwen2-MoE, Qwen3-MoE) or Mixtral's."""
    if c.router_scoring == "sigmoid":
        return "deepseek"
    return "qwen" if c.shared_expert_intermediate_size or c.qk_norm else "mixtral"


def moe_sources(
    c: LlamaConfig, layer: int, present: Collection[str] | None = None
) -> dict[str, Source]:
    """Layer ``layer``'s mixture of experts: router, experts (per expert or stacked, as the
    checkpoint ``present`` holds them), shared expert and its gate."""
    ours, hf = f"blocks.{layer}.mlp.", f"model.layers.{layer}."
    present = present or ()
    block = f"{hf}mlp."
    if moe_naming(c) == "mixtral" and f"{hf}mlp.gate.weight" not in present:
        block = f"{hf}block_sparse_moe."  # the files' name (transformers renames it on load)
    src = {f"{ours}router.weight": Source(f"{block}gate.weight")}
    if c.router_scoring == "sigmoid":  # the selection bias (a buffer)
        src[f"{ours}router.bias"] = Source(f"{block}gate.e_score_correction_bias")
    if f"{block}experts.gate_up_proj" in present:  # stacked, gate and up fused
        fused = f"{block}experts.gate_up_proj"
        src[f"{ours}experts.gate_proj"] = Source(fused, half=0)
        src[f"{ours}experts.up_proj"] = Source(fused, half=1)
        src[f"{ours}experts.down_proj"] = Source(f"{block}experts.down_proj")
    else:
        for p in MLP_PROJECTIONS:
            theirs = MIXTRAL_EXPERT_NAMES[p] if block.endswith("block_sparse_moe.") else p
            names = tuple(f"{block}experts.{e}.{theirs}.weight" for e in range(c.num_experts))
            src[f"{ours}experts.{p}"] = Source(names[0], experts=names)
    if c.shared_expert_intermediate_size:
        shared = "shared_experts" if moe_naming(c) == "deepseek" else "shared_expert"
        for p in MLP_PROJECTIONS:
            src[f"{ours}shared_expert.{p}.weight"] = Source(f"{hf}mlp.{shared}.{p}.weight")
    if c.shared_expert_gate:
        src[f"{ours}shared_expert_gate.weight"] = Source(f"{hf}mlp.shared_expert_gate.weight")
    return src


def latent_attention_sources(c: LlamaConfig, layer: int) -> dict[str, Source]:
    """Layer ``layer``'s multi-head latent attention (DeepSeek-V3): the same names as
    ``transformers``' ``self_attn``; the norms of the two latents; biases on q_a, kv_a and o
    with ``attention_bias``."""
    ours, hf = f"blocks.{layer}.attn.", f"model.layers.{layer}.self_attn."
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    names += ["q_proj"] if c.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    src = {f"{ours}{n}.weight": Source(f"{hf}{n}.weight") for n in names}
    biased = ["kv_a_proj_with_mqa"] + ([] if c.q_lora_rank is None else ["q_a_proj"])
    biased = (biased if c.attention_bias else []) + (["o_proj"] if c.attention_out_bias else [])
    src.update({f"{ours}{n}.bias": Source(f"{hf}{n}.bias") for n in biased})
    return src


def llama_sources(c: LlamaConfig, present: Collection[str] | None = None) -> dict[str, Source]:
    """The Llama family: llmlab's tensors under ``transformers``' names, nothing reordered."""
    src: dict[str, Source] = {
        "embed.tokens.weight": Source("model.embed_tokens.weight"),
        "head.norm.weight": Source("model.norm.weight"),
        "head.lm_head.weight": Source(
            "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
        ),
    }
    for i in range(c.n_layer):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        if c.latent_attention:
            src.update(latent_attention_sources(c, i))
        for mine, theirs in LLAMA_RENAMES.items():
            if mine.startswith("attn.") and c.latent_attention:
                continue
            if mine.endswith("_norm") and mine.startswith("attn.") and not c.qk_norm:
                continue
            src[f"{ours}{mine}.weight"] = Source(f"{hf}{theirs}.weight")
        if c.is_moe_layer(i):
            src.update(moe_sources(c, i, present))
        else:
            for p in MLP_PROJECTIONS:
                src[f"{ours}mlp.{p}.weight"] = Source(f"{hf}mlp.{p}.weight")
        if c.latent_attention:
            continue
        biased = ["q_proj", "k_proj", "v_proj"] if c.attention_bias else []
        biased += ["o_proj"] if c.attention_out_bias else []
        for p in biased:
            src[f"{ours}attn.{p}.bias"] = Source(f"{hf}self_attn.{p}.bias")
    return src


def sources_for(
    config: GPTConfig | LlamaConfig,
    prefix: str = "transformer.",
    present: Collection[str] | None = None,
) -> dict[str, Source]:
    """The name map of ``config``'s model; ``present``: the checkpoint's tensor names, where
    they decide between layouts (GPT-2's prefix is passed as ``prefix``)."""
    if isinstance(config, GPTConfig):
        return gpt2_sources(config, prefix)
    return llama_sources(config, present)


def is_inert_tensor(name: str, config: GPTConfig | LlamaConfig | None = None) -> bool:
    """A tensor the model never reads: the suffixes above, and a DeepSeek-V3 checkpoint's
    multi-token-prediction modules, stored as layers past ``num_hidden_layers``
    (``model.layers.61.*`` of DeepSeek-V3), which its causal LM does not run (transformers
    skips them on load too)."""
    if name.endswith(INERT_TENSOR_SUFFIXES):
        return True
    if isinstance(config, LlamaConfig) and config.latent_attention:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return int(parts[2]) >= config.n_layer
    return False
