"""``LLM``: the offline API -- a list of prompts in, a list of completions out.

All prompts are queued at once and the engine steps until every one is done, so they share
forwards (continuous batching), KV blocks (prefix caching) and the pool; the completions come
back in the prompts' order whatever order they finished in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any

from tqdm.auto import tqdm

from llmlab.decoding import GenerationConfig
from llmlab.serving.config import EngineConfig
from llmlab.serving.engine import LLMEngine, RequestOutput
from llmlab.serving.sequence import RequestOptions


@dataclass
class Completion:
    """One prompt's result: ``token_ids`` and ``texts`` hold ``num_return_sequences`` entries."""

    prompt_ids: list[int]
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]

    @classmethod
    def of(cls, output: RequestOutput) -> Completion:
        outs = sorted(output.outputs, key=lambda o: o.index)
        return cls(
            prompt_ids=output.prompt_ids,
            token_ids=[o.token_ids for o in outs],
            texts=[o.text for o in outs],
            finish_reasons=[o.finish_reason for o in outs],
        )


class LLM:
    """``LLM(model_or_checkpoint, tokenizer=None, **engine_config).generate(prompts, params)``.

    ``model_or_checkpoint``: a model meeting ``llmlab.serving.contracts.PagedModel`` (e.g.
    ``llmlab.models.GPT``), or a path that ``llmlab.serving.loading.load`` reads (then its
    tokenizer comes along). Keyword arguments are ``EngineConfig`` fields. ``adapters``: LoRA
    adapters by name (``llmlab.serving.adapters``), picked per call with ``generate(lora=)``.
    ``draft_model``: a model or path that proposes tokens with ``speculative="draft"``
    (``llmlab.serving.speculation``).
    """

    def __init__(
        self,
        model_or_checkpoint: Any,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        adapters: dict[str, Any] | None = None,
        draft_model: Any = None,
        **engine_config: Any,
    ) -> None:
        if isinstance(model_or_checkpoint, (str, PathLike)):
            from llmlab.serving.loading import load

            loaded = load(model_or_checkpoint, tokenizer=tokenizer)
            model_or_checkpoint, tokenizer = loaded.model, loaded.tokenizer
        if config is not None and engine_config:
            raise ValueError("give an EngineConfig or its fields as keywords, not both")
        config = config or EngineConfig(**engine_config)
        if isinstance(draft_model, (str, PathLike)):
            from llmlab.serving.loading import load

            draft_model = load(draft_model, tokenizer=tokenizer).model
        self.engine = LLMEngine(
            model_or_checkpoint, tokenizer, config, adapters=adapters, draft_model=draft_model
        )
        self.tokenizer = tokenizer
        self._ids = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: GenerationConfig | Sequence[GenerationConfig] | None = None,
        progress: bool = True,
        lora: str | None = None,
    ) -> list[Completion]:
        """Complete every prompt (text, or token ids) with ``params`` (one for all, or one per
        prompt), with the LoRA adapter named ``lora`` (None: the base); every request is
        checked before the first forward."""
        options = RequestOptions(adapter=lora)
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self._encode(p) for p in prompts]
        if params is None or isinstance(params, GenerationConfig):
            params = [params or GenerationConfig()] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} GenerationConfigs for {len(ids)} prompts")
        for prompt, config in zip(ids, params):
            self.engine.check_request(f"llm-{self._ids}", prompt, config, options)
        names = []
        for prompt, config in zip(ids, params):
            names.append(f"llm-{self._ids}")
            self._ids += 1
            self.engine.add_request(names[-1], prompt, config, options)
        done: dict[str, Completion] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=not progress)
        while self.engine.has_unfinished:
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = Completion.of(output)
                    bar.update(1)
            if not bar.disable:  # formatting it costs a few % of a batch-1 step
                bar.set_postfix(tokens_per_s=f"{self.engine.stats.tokens_per_second:.0f}")
        bar.close()
        return [done[name] for name in names]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: LLM(model, tokenizer=...)")
            return list(self.tokenizer.encode(prompt))
        return prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
