"""``ModelRunner``: feeds new tokens to a decodable model, with or without its KV cache.

The decoding contract (docs/architecture.md#contracts) is ``model(input_ids, attention=cache,
positions=, attention_mask=)`` plus ``model.new_cache(batch_size, max_len)``: the cache is the
forward's attention context (``llmlab.models.attention``) and has ``length``,
``reorder(indices)`` and ``crop(length)``. Every strategy talks to the model only through this
class, so each works on any model honouring the contract, cached or not:

* cached: the prompt is prefilled once, then only the new tokens go through the model;
* uncached: the whole sequence is recomputed at every call (the reference the cache is tested
  against).

The runner also keeps the running attention mask (left padding), extending it by ones as tokens
arrive; a batch without padding passes no mask at all, so the model keeps its fused causal path.

Two options change *how* the tokens reach the model, never which tokens come out:

* ``window``/``stride`` (sliding window, for generating past the model's context): the model
  sees at most ``window`` tokens. When the next feed would overflow, the context restarts at the
  last ``window - stride + 1`` tokens and is re-encoded from scratch (a fresh prefill: with
  learned absolute positions every kept token changes position, so no cached key is valid).
  ``stride=1`` is nanoGPT's ``idx[:, -block_size:]``: always the last ``window`` tokens, one
  full forward per new token; a larger stride re-encodes every ``stride`` tokens and decodes
  from the cache in between (the context then varies between ``window - stride + 1`` and
  ``window`` tokens). :func:`window_start` is the rule, for the runner and its tests alike.
* ``compile``: one-token steps go through the model's own forward compiled with
  ``torch.compile``, its cache seen as a fixed-shape context (the :class:`StaticCache`
  contract, ``cache.static_step(index, key_mask)``): the preallocated cache is written at a
  tensor index and attended over in full under a key mask, so no shape changes from step to
  step and a single graph serves the whole generation. Prefills stay eager.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@runtime_checkable
class StaticCache(Protocol):
    """What ``compile=True`` needs from the model's cache besides the decoding contract.

    ``static_step(index (1,), key_mask (B, max_len)) -> context``: an attention context that
    writes the new token's keys/values into slot ``index`` and attends over every slot where
    ``key_mask`` is True; shapes never depend on the step (``llmlab.models.KVCache`` has it).
    """

    max_len: int

    def static_step(self, index: Tensor, key_mask: Tensor) -> Any: ...


# One compiled forward per model object: a second ``generate`` call reuses the graph.
_COMPILED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

# Dynamo keeps every graph of a code object (a model class's forward) together, for every model
# of that class in the process, and fails a fullgraph call past its recompile limit (8). Each
# cache shape here, and each batch size and KV pool of a serving engine's compiled decode steps
# (llmlab.serving.compiled_decode), adds one: the limit is raised around these calls only.
COMPILED_GRAPHS_LIMIT = 64


def many_graphs() -> Any:
    """A context in which a compiled forward may hold up to :data:`COMPILED_GRAPHS_LIMIT`
    graphs."""
    return torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS_LIMIT)


def compiled_forward(model: Any, cache: Any) -> Any:
    """``torch.compile(model)`` (static shapes, whole graph) for one-token steps over ``cache``,
    cached per model."""
    if not isinstance(cache, StaticCache):
        raise ValueError(
            f"compile=True needs a cache with a fixed-shape static_step(index, key_mask); "
            f"{type(model).__name__} has none (its new_cache gives a {type(cache).__name__}; "
            "llmlab.models.KVCache has one)"
        )
    step = _COMPILED.get(model)
    if step is None:
        step = torch.compile(model, dynamic=False, fullgraph=True)
        _COMPILED[model] = step
    return step


def window_start(start: int, total: int, window: int | None, stride: int = 1) -> int:
    """Where the model's context begins once it holds tokens ``[start, total)``.

    Unchanged while at most ``window`` tokens; otherwise the last ``window - stride + 1``.
    """
    if window is None or total - start <= window:
        return start
    return total - (window - stride + 1)


class ModelRunner:
    """Incremental forward passes over a batch of ``batch_size`` rows of at most ``max_len``."""

    def __init__(
        self,
        model: Any,
        batch_size: int,
        max_len: int,
        use_cache: bool = True,
        attention_mask: Tensor | None = None,
        window: int | None = None,
        stride: int = 1,
        compile: bool = False,
    ) -> None:
        """``max_len``: the longest sequence this runner will see (prompt + new tokens); with a
        ``window`` the cache only ever holds ``min(max_len, window)`` tokens."""
        self.model = model
        self.use_cache = use_cache
        self.window, self.stride = window, stride
        cache_len = max_len if window is None else min(max_len, window)
        self.cache = model.new_cache(batch_size, cache_len) if use_cache else None
        forward = getattr(model, "forward", model)
        self._keep_logits = _accepts(forward, "logits_to_keep")
        if attention_mask is not None and bool(attention_mask.bool().all()):
            attention_mask = None  # no padding: the plain causal path is exact and faster
        self.mask = attention_mask.long() if attention_mask is not None else None
        # The full sequence: needed without a cache, and to re-encode a sliding window.
        self.keep_tokens = not use_cache or window is not None
        self.tokens: Tensor | None = None
        self.total = 0  # tokens fed so far
        self.start = 0  # first token of the model's current context (sliding window)
        self.step = compiled_forward(model, self.cache) if compile and use_cache else None

    @property
    def length(self) -> int:
        """Tokens in the model's current context (what its cache holds)."""
        return self.total - self.start

    def feed(self, new_ids: Tensor, keep: int = 1) -> Tensor:
        """Run ``new_ids`` (N, T); return float32 logits (N, keep, V) of the last ``keep`` tokens.

        The mask given at construction covers the first call's tokens; later tokens are real.
        """
        T = new_ids.shape[1]
        total = self.total + T
        if self.mask is not None and self.mask.shape[1] < total:
            pad = self.mask.new_ones(self.mask.shape[0], total - self.mask.shape[1])
            self.mask = torch.cat([self.mask, pad], dim=1)
        if self.keep_tokens:
            self.tokens = new_ids if self.tokens is None else torch.cat([self.tokens, new_ids], 1)
        start = window_start(self.start, total, self.window, self.stride)
        if not self.use_cache or start != self.start:
            # No cache, or the window slid: (re-)encode the whole context from scratch.
            if self.cache is not None:
                self.cache.crop(0)
            self.start = start
            logits = self._forward(self.tokens[:, start:total], total, keep)
        elif self.step is not None and T == 1 and self.total > 0:
            logits = self._static_step(new_ids)
        else:
            logits = self._forward(new_ids, total, keep)
        self.total = total
        return logits[:, -keep:].float()

    def _forward(self, ids: Tensor, total: int, keep: int) -> Tensor:
        """Eager forward of ``ids``, the tokens up to ``total`` not yet in the cache."""
        mask = self.mask[:, self.start : total] if self.mask is not None else None
        kwargs: dict[str, Any] = {"attention_mask": mask}
        if self._keep_logits:
            kwargs["logits_to_keep"] = keep
        if self.cache is not None:
            return self.model(ids, attention=self.cache, **kwargs)
        return self.model(ids, **kwargs)

    def _static_step(self, new_ids: Tensor) -> Tensor:
        """One token through the compiled forward over the cache's fixed-shape view; the cache
        advances here."""
        cache, n = self.cache, self.length
        if n >= cache.max_len:
            raise ValueError(f"KV cache overflow: {n + 1} tokens do not fit in {cache.max_len}")
        rows = new_ids.shape[0]
        key_mask = torch.zeros(rows, cache.max_len, dtype=torch.bool, device=new_ids.device)
        if self.mask is not None:
            key_mask[:, : n + 1] = self.mask[:, self.start : self.total + 1].bool()
            positions = key_mask.sum(-1, keepdim=True) - 1  # real tokens before, as HF
        else:
            key_mask[:, : n + 1] = True
            positions = torch.full((rows, 1), n, dtype=torch.long, device=new_ids.device)
        index = torch.tensor([n], device=new_ids.device)
        with many_graphs():
            logits = self.step(new_ids, positions=positions,
                               attention=cache.static_step(index, key_mask))  # fmt: skip
        cache.length += 1
        return logits

    def reorder(self, rows: Tensor) -> None:
        """Keep (or repeat) rows ``rows`` of the batch, e.g. the parents of the surviving beams."""
        if self.cache is not None:
            self.cache.reorder(rows)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, rows)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, rows)

    def crop(self, length: int) -> None:
        """Forget everything after ``length`` tokens (speculative decoding's rejected drafts)."""
        if self.start:
            raise ValueError("crop after the sliding window moved is not supported")
        if self.cache is not None:
            self.cache.crop(length)
        if self.tokens is not None:
            self.tokens = self.tokens[:, :length]
        self.total = length
