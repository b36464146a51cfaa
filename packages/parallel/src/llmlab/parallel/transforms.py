"""``ModelTransforms``: the options that change how a model computes, not where it lives.

A small value type of its own (no Lightning, no process groups) so that the modules that read
these options -- data-parallel wrappers, config validation, the strategy -- import it from here
instead of reaching up into :mod:`llmlab.parallel.parallelize`, which applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelTransforms:
    """Options that change how the model computes, not where it lives.

    ``activation_checkpointing``: checkpoint every n-th repeated block (None: off).
    ``recompute_attention``: the query-block size of memory-efficient attention (None: off).
    ``compile``: ``torch.compile`` each repeated block in place, and the loss
    (:mod:`llmlab.parallel.compile`).
    """

    activation_checkpointing: int | None = None
    recompute_attention: int | None = None
    compile: bool = False

    @property
    def active(self) -> bool:
        """Whether any option changes the model (all off is the identity)."""
        return self != ModelTransforms()

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | ModelTransforms | None) -> ModelTransforms:
        """Accept the config forms: ``{activation_checkpointing: n | {every: n} | true,
        recompute_attention: true | {block_size: n}, compile: bool}``; unknown keys are an
        error."""
        if isinstance(config, ModelTransforms):
            return config
        config = dict(config or {})
        valid = ("activation_checkpointing", "recompute_attention", "compile")
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise ValueError(f"unknown model transform(s) {unknown}; valid: {', '.join(valid)}")
        compile_ = config.get("compile") or False
        if not isinstance(compile_, bool):
            raise ValueError(f"compile must be true or false, got {compile_!r}")
        ac = config.get("activation_checkpointing")
        if isinstance(ac, Mapping):
            ac = ac.get("every", 1)
        elif ac is True:
            ac = 1
        elif ac is False:
            ac = None
        ra = config.get("recompute_attention")
        if isinstance(ra, Mapping):
            ra = ra.get("block_size", 128)
        elif ra is True:
            ra = 128
        elif ra is False:
            ra = None
        for name, value in (("activation_checkpointing", ac), ("recompute_attention", ra)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a bool, an int or a mapping, got {value!r}")
        return cls(activation_checkpointing=ac, recompute_attention=ra, compile=compile_)
