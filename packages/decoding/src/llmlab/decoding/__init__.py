"""llmlab.decoding: greedy, sampling, beam, exhaustive and speculative decoding with a KV cache.

Works on any model that follows the decoding contract (docs/architecture.md#contracts):
``model(input_ids, attention=cache, positions=, attention_mask=) -> logits`` plus
``model.new_cache(batch_size, max_len)``, e.g. ``llmlab.models.GPT`` and ``llmlab.models.Llama``, or
a HF causal LM wrapped in ``HFModel``. Depends on torch only."""

from llmlab.decoding.beam import beam_search
from llmlab.decoding.config import GenerationConfig
from llmlab.decoding.exhaustive import exhaustive_search
from llmlab.decoding.generate import generate
from llmlab.decoding.hf import HFModel
from llmlab.decoding.processors import build_processors
from llmlab.decoding.sampling import decode_one_by_one
from llmlab.decoding.speculative import SpeculativeStats, speculative_generate
from llmlab.decoding.streaming import TextStreamer

__all__ = [
    "GenerationConfig",
    "HFModel",
    "SpeculativeStats",
    "TextStreamer",
    "beam_search",
    "build_processors",
    "decode_one_by_one",
    "exhaustive_search",
    "generate",
    "speculative_generate",
]
