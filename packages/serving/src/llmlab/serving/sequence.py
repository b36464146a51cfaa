"""Requests and sequences: what the scheduler schedules and the block manager books.

A :class:`Request` is what a user sent: a prompt and a ``GenerationConfig``. It decodes as
``num_return_sequences`` :class:`Sequence` s. Until its prompt is computed it has one sequence;
when the first token is due, that sequence forks into the others (sharing every KV block), and
from then on each sequence is scheduled, preempted and finished on its own. A beam-search
request runs ``num_beams`` sequences instead, re-forked at every step (``llmlab.serving.beam``).

A sequence's state is three numbers and a list: ``token_ids`` (prompt, then generated),
``num_computed`` (tokens whose keys and values are in the KV pool), and ``block_table`` (the
pool blocks holding them). One step computes some of the ``len(token_ids) - num_computed``
tokens not yet in the pool; when none is left, the last one's logits give the next token.

What a request asks beyond its ``GenerationConfig`` (log-probabilities, a prompt computed with
no token generated) is its :class:`RequestOptions`.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmlab.decoding import GenerationConfig

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [low, high)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``.

    Choice 0 uses ``seed`` itself, so a request with one choice draws what
    ``llmlab.decoding.generate(seed=seed)`` draws. Choice ``i > 0`` uses 63 bits of a hash of
    ``(seed, i)``: with ``seed + i``, ``seed=42, n=2`` would repeat ``seed=43``'s first choice.
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class RequestOptions:
    """A request's options that are not decoding rules (``GenerationConfig`` holds those).

    ``logprobs``: report each generated token's log-probability and the ``logprobs`` most
    likely tokens at its step (0: the chosen token's alone); ``prompt_logprobs``: the same for
    every prompt token but the first (which has no context), computed from the logits at every
    prompt position in prefill (the request then skips the prefix cache: a cached block has no
    logits); ``prompt_only``: compute the prompt and generate nothing (OpenAI's ``max_tokens:
    0`` with ``echo``). Log-probabilities are the log-softmax of the model's logits as the
    forward returns them, before any logits processor, temperature or mask. ``grammar``: an
    llguidance grammar (``llmlab.serving.structured``) every sequence's text must follow.
    ``adapter``: the name of the LoRA adapter the request decodes with (``llmlab.serving.
    adapters``); None: the base model.
    """

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    grammar: str | None = None
    adapter: str | None = None


@dataclass
class TokenLogprob:
    """One token's log-probability, and the ``top`` most likely ids at its position (best
    first, as ``(id, logprob)``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's num_return_sequences
    token_ids: list[int]
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (eos or stop string), "length" or "abort"
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked
    grammar: Any = None  # its llguidance matcher (RequestOptions.grammar), at its accepted tokens
    # speculative decoding (llmlab.serving.speculation): slots to book beyond the next token
    # for drafts this step, and how many leading tokens the draft model's KV pool holds
    lookahead: int = 0
    draft_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def order(self) -> tuple[int, int]:
        """Arrival order, for FIFO admission and newest-first preemption."""
        return (self.request.order, self.index)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def cache_salt(self) -> str | None:
        """Where its prefix-cache chain starts: its adapter (blocks never shared across)."""
        return self.request.options.adapter


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    config: GenerationConfig
    order: int  # arrival counter
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # whether the num_return_sequences sequences exist yet
    beam: Any = None  # the request's llmlab.serving.beam.BeamGroup when it decodes by beam search
    options: RequestOptions = field(default_factory=RequestOptions)
    # the prompt's tokens' log-probabilities (options.prompt_logprobs): None for the first token,
    # then one per prompt position as prefill computes them
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs once forked: its beams, or its return sequences."""
        return self.config.num_beams if self.beam is not None else self.config.num_return_sequences

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.sequences)

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prefill must keep the logits of every prompt position (and so may not start
        from prefix-cache blocks, which have none): until every prompt token has its
        log-probability."""
        return (
            self.options.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def new_sequence(
        self, index: int, token_ids: list[int], device: torch.device | str = "cpu"
    ) -> Sequence:
        """A sequence of this request, with its own random stream when a seed is set.

        Sequence ``i`` draws from ``torch.Generator(device).manual_seed(choice_seed(seed, i))``:
        its samples depend only on its own tokens, never on what else shares the batch or the
        step.
        """
        generator = None
        if self.config.seed is not None:
            seed = choice_seed(self.config.seed, index)
            generator = torch.Generator(device=device).manual_seed(seed)
        seq = Sequence(self, index, list(token_ids), generator=generator)
        self.sequences.append(seq)
        return seq
