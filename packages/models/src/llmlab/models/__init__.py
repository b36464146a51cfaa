"""llmlab.models: plain ``nn.Module`` models that follow the pipeline, tensor-parallel and
decoding contracts of DESIGN §3 (no Lightning here)."""

from llmlab.models.gpt import GPT, GPTConfig
from llmlab.models.kv_cache import KVCache
from llmlab.models.resnet import ResNet50

__all__ = ["GPT", "GPTConfig", "KVCache", "ResNet50"]
