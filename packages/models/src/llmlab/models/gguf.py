"""GGUF files (llama.cpp's format) of the Llama family in: the same weights here and in llama.cpp.

A GGUF file holds metadata (``llama.block_count``, ``llama.attention.head_count``, ...) and
tensors named llama.cpp's way (``blk.3.attn_q.weight``), each in one of ggml's types: F32, F16,
BF16, or block-quantized (Q8_0: 32 weights share one fp16 scale; Q4_0: the same with 4-bit
values, ...). Reading one is a translation into an HF-style config and state dict, then the
same conversion ``from_pretrained`` uses for folders (every field checked, anything unknown
refused by name):

* the metadata becomes ``config.json``'s fields (``embedding_length`` → ``hidden_size``, ...);
* each tensor is dequantized to fp32 by the ``gguf`` package's own code (``gguf.quants``) and
  renamed (``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``);
* llama.cpp's converter permutes the rows of q and k from HF's rotate-half RoPE pairs to
  adjacent pairs (its ``LlamaModel.permute``); the inverse permutation is applied here.

A quantized file is widened to fp32 weights (quantize again with ``llmlab.models.quantize`` if
fewer bytes are wanted: the formats differ, so that is a second rounding). Needs the ``gguf``
package (``pip install llmlab-models[gguf]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

ARCHITECTURES = ("llama",)

# llama.cpp's tensor names (gguf.constants.TENSOR_NAMES for LLM_ARCH_LLAMA) -> transformers'
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The HF-style config dict and fp32 state dict of the GGUF file at ``path``."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'llmlab-models[gguf]'"
        ) from err
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from err
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: general.architecture={arch!r} is not supported; valid: {list(ARCHITECTURES)}"
        )
    tensors = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type)  # the gguf package's own dequantization
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the innermost first
        tensors[t.name] = torch.from_numpy(np.array(data, np.float32).reshape(shape))  # a copy
    config = hf_config(meta, tensors, path)
    return config, hf_state(tensors, config, path)


def _get(meta: dict[str, Any], key: str, path: Path, default: Any = None) -> Any:
    value = meta.get(f"llama.{key}", default)
    if value is None:
        raise ValueError(f"{path}: metadata llama.{key} is missing")
    return value


def hf_config(meta: dict[str, Any], tensors: dict[str, Tensor], path: Path) -> dict[str, Any]:
    """``config.json``'s fields from llama.cpp's metadata (the keys its converter writes)."""
    if "rope_freqs.weight" in tensors or "llama.rope.scaling.type" in meta:
        raise ValueError(
            f"{path}: RoPE scaling (rope_freqs.weight / llama.rope.scaling.*) is not "
            "implemented for GGUF files; refusing to load the model approximately"
        )
    heads = int(_get(meta, "attention.head_count", path))
    width = int(_get(meta, "embedding_length", path))
    head_dim = int(meta.get("llama.attention.key_length", width // heads))
    return {
        "model_type": "llama",
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "hidden_size": width,
        "intermediate_size": int(_get(meta, "feed_forward_length", path)),
        "num_hidden_layers": int(_get(meta, "block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_get(meta, "context_length", path)),
        "rms_norm_eps": float(_get(meta, "attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }


def unpermute(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows: within each head, rows ``(i, i + D/2)``
    (HF's rotate-half pairs) had been laid out as ``(2i, 2i + 1)``."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def hf_state(tensors: dict[str, Tensor], config: dict[str, Any], path: Path) -> dict[str, Tensor]:
    """The tensors under transformers' names, q and k rows back in HF's order."""
    state = {}
    for name, tensor in tensors.items():
        if name in TOP_TENSORS:
            state[TOP_TENSORS[name]] = tensor
            continue
        prefix, _, rest = name.partition(".")
        layer, _, leaf = rest.partition(".")
        if prefix != "blk" or not layer.isdigit() or leaf not in LAYER_TENSORS:
            raise ValueError(f"{path}: tensor {name!r} is not part of a llama model here")
        if leaf == "attn_q.weight":
            tensor = unpermute(tensor, config["num_attention_heads"])
        elif leaf == "attn_k.weight":
            tensor = unpermute(tensor, config["num_key_value_heads"])
        state[f"model.layers.{layer}.{LAYER_TENSORS[leaf]}"] = tensor
    return state


def from_gguf(path: str | Path, *, dtype: torch.dtype | None = None, **use: Any) -> Any:
    """llmlab's ``Llama`` with the config and weights of the GGUF file at ``path`` (module
    docstring); ``dtype`` casts the parameters (default fp32), ``use`` as ``from_pretrained``."""
    from llmlab.models.hf.convert import model_from_hf_state
    from llmlab.models.llama import Llama, LlamaConfig

    config, state = read_gguf(path)
    model = model_from_hf_state(Llama, LlamaConfig, config, state, use)
    return model.to(dtype) if dtype is not None else model
