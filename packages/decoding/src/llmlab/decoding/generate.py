"""``generate``: the one public entry point, dispatching to a strategy.

The output is laid out like HF ``generate``: prompt (left padding included) plus new tokens,
shape ``(batch * num_return_sequences, length)``, rows that stopped early padded with
``pad_token_id``. Sequences of one prompt are adjacent (row ``b * n + i``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.decoding.beam import beam_search
from llmlab.decoding.config import GenerationConfig
from llmlab.decoding.exhaustive import check_exhaustive_size, exhaustive_search
from llmlab.decoding.sampling import decode_one_by_one
from llmlab.decoding.speculative import speculative_generate


def _check_inputs(input_ids: Tensor, attention_mask: Tensor | None) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (
            f"{tuple(input_ids.shape)} {input_ids.dtype}"
            if isinstance(input_ids, Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(f"input_ids must be a LongTensor of shape (batch, length), got {got}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one prompt token per row")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "attention_mask has padding on the right; decoder-only generation needs left "
                "padding (pad at the start of each row)"
            )


@torch.inference_mode()
def generate(
    model: Any,
    input_ids: Tensor,
    config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    streamer: Any = None,
    *,
    tokenizer: Any = None,
    draft_model: Any = None,
    compile: bool = False,
    **overrides: Any,
) -> Tensor:
    """Continue ``input_ids`` (B, P) with ``model`` as ``config`` says; see the module docstring.

    ``overrides`` replace config fields (``generate(m, ids, max_new_tokens=5)``).
    ``tokenizer`` is needed for ``stop_strings``; ``draft_model`` selects speculative decoding.
    ``compile=True`` (greedy and sampling) runs each one-token step through
    ``torch.compile(model)`` over a fixed-shape view of its cache: the same tokens, less per-step
    overhead once compiled (the first call compiles, later calls reuse the graph).
    """
    config = config or GenerationConfig()
    if overrides:
        unknown = sorted(set(overrides) - set(GenerationConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown GenerationConfig fields {unknown}")
        config = config.replace(**overrides)
    config.validate()
    _check_inputs(input_ids, attention_mask)
    strategy = config.resolved_strategy(has_draft=draft_model is not None)
    if compile and strategy not in ("greedy", "sample"):
        raise ValueError(
            f"compile=True works with greedy decoding and sampling, not strategy={strategy!r}"
        )
    if compile and not config.use_cache:
        raise ValueError("compile=True compiles the cached decode step; it needs use_cache=True")
    if strategy == "speculative" and draft_model is None:
        raise ValueError("strategy='speculative' needs generate(..., draft_model=small_model)")
    if streamer is not None:
        if input_ids.shape[0] != 1 or config.num_return_sequences != 1:
            raise ValueError(
                f"a streamer follows one sequence: got batch size {input_ids.shape[0]} and "
                f"num_return_sequences={config.num_return_sequences}"
            )
        if strategy in ("beam", "exhaustive"):
            raise ValueError(f"streaming is not supported for strategy={strategy!r}")
        streamer.put(input_ids[0].cpu())

    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(config.seed)

    if strategy == "beam":
        out = beam_search(model, input_ids, config, attention_mask, tokenizer, generator)
    elif strategy == "exhaustive":
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            check_exhaustive_size(vocab, config)
        out = exhaustive_search(model, input_ids, config, attention_mask, tokenizer)
    else:
        n = config.num_return_sequences
        ids = input_ids.repeat_interleave(n, 0) if n > 1 else input_ids
        mask = attention_mask
        if mask is not None and n > 1:
            mask = mask.repeat_interleave(n, 0)
        if strategy == "speculative":
            out, _ = speculative_generate(
                model, draft_model, ids, config, mask, tokenizer, streamer, generator
            )
        else:
            out = decode_one_by_one(
                model,
                ids,
                config,
                mask,
                streamer,
                tokenizer,
                generator,
                strategy == "sample",
                compile=compile,
            )
    if streamer is not None:
        streamer.end()
    return out
