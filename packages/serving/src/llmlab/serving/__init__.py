"""llmlab.serving: a paged KV cache, a continuous-batching scheduler and an OpenAI-compatible
server.

``LLM(model).generate(prompts, params)`` is the offline API; ``python -m llmlab.serving MODEL``
serves ``/v1/completions`` and ``/v1/chat/completions``. Underneath, each part works alone:
``BlockManager`` (paged KV bookkeeping, prefix cache, copy-on-write), ``Scheduler`` (continuous
batching, chunked prefill, preemption), ``ModelRunner`` (one packed forward over the paged pool)
and ``LLMEngine`` (the step that joins them). Models meet ``contracts.PagedModel``
structurally; the engine never imports ``llmlab.train`` or ``llmlab.parallel``.
"""

from llmlab.serving.block_manager import BlockManager
from llmlab.serving.config import EngineConfig
from llmlab.serving.contracts import PagedModel
from llmlab.serving.engine import LLMEngine, RequestOutput, SequenceOutput
from llmlab.serving.llm import LLM, Completion
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.scheduler import Scheduler
from llmlab.serving.sequence import RequestOptions, TokenLogprob

__all__ = [
    "LLM",
    "BlockManager",
    "Completion",
    "EngineConfig",
    "LLMEngine",
    "ModelRunner",
    "PagedModel",
    "RequestOptions",
    "RequestOutput",
    "Scheduler",
    "SequenceOutput",
    "TokenLogprob",
]
