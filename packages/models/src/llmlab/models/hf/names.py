"""The name map of each family: llmlab parameter name -> :class:`Source` in the HF checkpoint.

Built from the llmlab config alone (no file read), so a caller can ask for any subset -- a
pipeline stage's layers -- before opening a single tensor.
"""

from __future__ import annotations

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
    **{f"mlp.{p}": f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
}


def llama_sources(c: LlamaConfig) -> dict[str, Source]:
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
        for mine, theirs in LLAMA_RENAMES.items():
            if mine.endswith("_norm") and mine.startswith("attn.") and not c.qk_norm:
                continue
            src[f"{ours}{mine}.weight"] = Source(f"{hf}{theirs}.weight")
        biased = ["q_proj", "k_proj", "v_proj"] if c.attention_bias else []
        biased += ["o_proj"] if c.attention_out_bias else []
        for p in biased:
            src[f"{ours}attn.{p}.bias"] = Source(f"{hf}self_attn.{p}.bias")
    return src


def sources_for(config: GPTConfig | LlamaConfig, prefix: str = "transformer.") -> dict[str, Source]:
    if isinstance(config, GPTConfig):
        return gpt2_sources(config, prefix)
    return llama_sources(config)


def is_inert_tensor(name: str) -> bool:
    return name.endswith(INERT_TENSOR_SUFFIXES)
