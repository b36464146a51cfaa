"""Fault injection: make one stage of the engine fail for chosen requests, to test isolation.

A fault while serving one request must end that request and nothing else. The tests prove it
by injecting one: ``EngineConfig(inject_fault="sampling:BOOM")`` (or the environment variable
``LLMLAB_SERVING_INJECT_FAULT=sampling:BOOM`` when the config leaves it unset) makes every
request whose prompt text contains ``BOOM`` raise :class:`InjectedFault` at that stage:

* ``forward``: the batched forward of any step that computes a chunk of such a request (every
  request of that step fails, as a real fault in a shared forward would make them);
* ``logits``: before the request's logits processors run;
* ``sampling``: before its next token is picked;
* ``logprobs``: before its tokens' log-probabilities are computed (requests that ask for them);
* ``grammar``: before its next-token mask is computed (requests with structured output);
* ``detokenize``: when its new tokens are turned into text.

Off (the default), nothing is decoded and nothing is checked per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

STAGES = ("forward", "logits", "sampling", "logprobs", "grammar", "detokenize")
ENV = "LLMLAB_SERVING_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


@dataclass(frozen=True)
class FaultInjection:
    stage: str
    marker: str

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection | None:
        """``"stage:marker"`` -> a FaultInjection (``None``/empty: none); a bad spec is a
        ``ValueError`` naming the stages."""
        if not spec:
            return None
        stage, sep, marker = spec.partition(":")
        if not sep or stage not in STAGES or not marker:
            raise ValueError(
                f"inject_fault={spec!r}: expected 'stage:marker' with a stage of {list(STAGES)} "
                f"and a non-empty marker (the prompt text that triggers it)"
            )
        return cls(stage, marker)

    @classmethod
    def from_config(cls, spec: str | None) -> FaultInjection | None:
        return cls.parse(spec if spec is not None else os.environ.get(ENV))

    def stage_for(self, prompt_ids: list[int], tokenizer: Any) -> str | None:
        """The stage at which a request with this prompt fails, or None."""
        if tokenizer is None:
            return None
        try:
            text = tokenizer.decode(prompt_ids)
        except Exception:  # an undecodable prompt is no marker
            return None
        return self.stage if self.marker in text else None


def fire(stage: str, planned: str | None) -> None:
    """Raise the injected fault if ``planned`` (a request's fault stage) is ``stage``."""
    if planned == stage:
        raise InjectedFault(f"injected fault at the {stage} stage")
