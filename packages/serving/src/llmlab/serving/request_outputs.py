"""What the engine reports: each request's new tokens, text and log-probabilities since its
previous output, rendered from the per-request state the engine tracks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmlab.serving.detokenize import IncrementalText
from llmlab.serving.faults import fire
from llmlab.serving.sampler import Rules
from llmlab.serving.sequence import Request, Sequence, Status, TokenLogprob


@dataclass
class SequenceOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    text: str  # the text released so far (see llmlab.serving.detokenize)
    new_token_ids: list[int]  # since this sequence's previous output
    new_text: str
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    # the new tokens' log-probabilities (RequestOptions.logprobs), one per new token
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    outputs: list[SequenceOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the request failed (then finished): "<stage>: <exception>"
    # RequestOptions.prompt_logprobs: one per prompt token (None for the first), in the first
    # output after prefill computed them (None in the others)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class TrackedRequest:
    """The engine's per-request extras: decoding rules, texts, what was reported."""

    request: Request
    rules: Rules
    texts: dict[int, IncrementalText] = field(default_factory=dict)
    reported: dict[int, int] = field(default_factory=dict)  # tokens already reported
    prompt_reported: bool = False  # the prompt's log-probabilities (reported once)


def report(tracked: TrackedRequest, tokenizer: Any) -> RequestOutput:
    """The request's output since its previous one (marking it reported). Rendering the text
    may raise (an undecodable id, an injected ``detokenize`` fault): the engine fails the
    request alone then."""
    request = tracked.request
    outputs = []
    for seq in request.sequences:
        seen = tracked.reported.get(seq.index, 0)
        generated = seq.output_ids
        new = generated[seen:]
        tracked.reported[seq.index] = len(generated)
        text, delta = _text(tracked, seq, new, tokenizer)
        outputs.append(
            SequenceOutput(
                seq.index,
                list(generated),
                text,
                new,
                delta,
                seq.finish_reason,
                seq.logprobs[seen:],
            )
        )
    prompt_logprobs = None
    wanted = request.options.prompt_logprobs is not None and not tracked.prompt_reported
    if wanted and not request.needs_prompt_logits:
        prompt_logprobs, tracked.prompt_reported = list(request.prompt_logprobs), True
    return RequestOutput(
        request.request_id,
        request.prompt_ids,
        outputs,
        request.is_finished,
        request_metrics(request),
        prompt_logprobs=prompt_logprobs,
    )


def _text(
    tracked: TrackedRequest, seq: Sequence, new: list[int], tokenizer: Any
) -> tuple[str, str]:
    if tokenizer is None:
        return "", ""
    text = tracked.texts.get(seq.index)
    if text is None:
        stops = tracked.request.config.stop_string_list
        text = tracked.texts[seq.index] = IncrementalText(tokenizer, stops)
    fire("detokenize", tracked.rules.fault)
    final = seq.status is Status.FINISHED
    if final and new and new[-1] in tracked.rules.eos:
        new = new[:-1]  # the eos token is special: not rendered
    delta = text.add(new, final=final)
    return text.text, delta


def request_metrics(request: Request) -> dict[str, float]:
    """The request's timings: its arrival and, once it has one, its time to first token."""
    metrics = {"arrival_time": request.arrival_time}
    if request.first_token_time is not None:
        metrics["time_to_first_token"] = request.first_token_time - request.arrival_time
    return metrics
