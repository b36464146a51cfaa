"""llmlab.models: plain ``nn.Module`` models that follow the pipeline, tensor-parallel and decoding
contracts of docs/architecture.md#contracts (no Lightning here). ``build_model({"arch": ...})``
builds any registered language model from its config dict; ``from_pretrained(folder)`` and
``save_pretrained(model, folder)`` read and write Hugging Face-format folders (config.json +
safetensors) without ``transformers``; ``quantize(model, "int8")`` stores its weights in fewer
bytes (bf16, int8, int4); ``apply_lora(model, LoRAConfig(...))`` puts low-rank adapters on its
linear layers (peft's adapter format: ``save_lora`` / ``load_lora``)."""

from llmlab.models.gpt import GPT, GPTConfig
from llmlab.models.hf import from_pretrained, save_pretrained
from llmlab.models.kv_cache import KVCache
from llmlab.models.linear import Linear
from llmlab.models.llama import Llama, LlamaConfig
from llmlab.models.lora import LoRAConfig, LoRALinear, apply_lora, load_lora, save_lora
from llmlab.models.moe import MoE, MoEConfig, MoEStats, load_balancing_loss
from llmlab.models.quantize import QuantizedEmbedding, QuantizedLinear, quantize
from llmlab.models.registry import (
    ARCHITECTURES,
    build_model,
    from_state_dict,
    model_config,
    register,
)
from llmlab.models.resnet import ResNet50

__all__ = [
    "ARCHITECTURES",
    "GPT",
    "GPTConfig",
    "KVCache",
    "Linear",
    "Llama",
    "LlamaConfig",
    "LoRAConfig",
    "LoRALinear",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "ResNet50",
    "apply_lora",
    "build_model",
    "from_pretrained",
    "from_state_dict",
    "load_balancing_loss",
    "load_lora",
    "model_config",
    "quantize",
    "register",
    "save_lora",
    "save_pretrained",
]
