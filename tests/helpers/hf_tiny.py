"""Tiny random ``transformers`` causal LMs of every family llmlab loads, saved as HF folders.

Each variant is built offline from a config (nothing downloaded), its norm weights and biases
perturbed away from 1/0 so that a mix-up of norms or a dropped bias shows in the logits, and
written with ``save_pretrained`` -- the files a user would have on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=500.0,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (transformers family, config overrides, save_pretrained kwargs)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama2-mha-untied": ("Llama", dict(num_key_value_heads=4), {}),
    "llama-gqa-bias-sharded": (
        "Llama",
        dict(attention_bias=True),
        dict(max_shard_size="20KB"),
    ),
    "llama3.2-rope-tied-headdim": (
        "Llama",
        dict(tie_word_embeddings=True, head_dim=16, rope_scaling=LLAMA3_ROPE),
        {},
    ),
    "llama-linear-rope": (
        "Llama",
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        {},
    ),
    "mistral-window": ("Mistral", dict(sliding_window=6), {}),
    "qwen2-bias-window": (
        "Qwen2",
        dict(
            tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=1
        ),
        {},
    ),
    "qwen3-qknorm-headdim": ("Qwen3", dict(head_dim=24), {}),
    "gpt2-tied": ("GPT2", {}, {}),
    "gpt2-untied-sharded": ("GPT2", dict(tie_word_embeddings=False), dict(max_shard_size="30KB")),
}


def build_hf(family: str, overrides: dict[str, Any], seed: int = 0) -> Any:
    import transformers  # imported when used: the experiments test loads this module too

    torch.manual_seed(seed)
    if family == "GPT2":
        config = transformers.GPT2Config(
            vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
            **overrides,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = getattr(transformers, f"{family}Config")(**{**COMMON, **overrides})
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_variant(name: str, root: Path) -> tuple[Any, Path]:
    """The HF model of variant ``name`` and the folder it was saved to."""
    family, overrides, save_kwargs = VARIANTS[name]
    model = build_hf(family, overrides)
    folder = root / name
    model.save_pretrained(folder, **save_kwargs)
    return model, folder


def byte_level_llama_folder(
    folder: Path, seed: int = 0, family: str = "Llama", **overrides: Any
) -> tuple[Any, Path]:
    """A tiny random ``LlamaForCausalLM`` (or another ``family``'s model, with config
    ``overrides``) over the 256 bytes, with the byte tokenizer's HF files: a complete folder for
    ``model.init_from`` (the byte-level Shakespeare data fits it)."""
    from llmlab.tokenizer.hf_folder import HFTokenizerFiles
    from llmlab.train.data import ByteTokenizer

    config = dict(vocab_size=256, max_position_embeddings=256, **overrides)
    model = build_hf(family, config, seed)
    model.save_pretrained(folder)
    HFTokenizerFiles(ByteTokenizer().as_bpe(), model_max_length=256).save_pretrained(folder)
    return model, folder


def experiment_user_files(name: str, root: Path) -> list[str]:
    """The overrides naming what a user brings to experiment ``name`` (made here, offline): a
    Hugging Face-format folder for the fine-tuning experiments, nothing for the others."""
    if name == "llama_finetune":
        _, folder = byte_level_llama_folder(root / "pretrained")
        return [f"model.init_from={folder}"]
    if name == "moe_finetune":  # a Mixtral-format folder: 4 experts, top-2
        experts = dict(num_local_experts=4, num_experts_per_tok=2)
        _, folder = byte_level_llama_folder(root / "pretrained", family="Mixtral", **experts)
        return [f"model.init_from={folder}"]
    return []


def hf_greedy(hf: Any, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """HF ``generate``'s ``n`` greedy tokens after ``prompt``: an explicit mask (HF would mask
    prompt tokens equal to ``pad_token_id``) and no EOS, so all ``n`` tokens are compared."""
    hf.generation_config.eos_token_id = None
    mask = torch.ones_like(prompt)
    out = hf.generate(prompt, attention_mask=mask, max_new_tokens=n, do_sample=False)
    return out[:, prompt.shape[1] :]


def engine_matches_hf_greedy(model: Any, hf: Any, prompts: list[list[int]], n: int) -> Any:
    """Serve ``prompts`` together through a small paged engine (4-token blocks: every prompt
    spans several, the requests share the pool) and assert each request's ``n`` greedy tokens
    are HF ``generate``'s on that prompt alone; returns the engine."""
    from llmlab.decoding import GenerationConfig
    from llmlab.serving import EngineConfig, LLMEngine

    config = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64)
    engine = LLMEngine(model, config=config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GenerationConfig(max_new_tokens=n))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        assert done[str(i)] == hf_greedy(hf, torch.tensor([prompt]), n)[0].tolist(), i
    return engine
