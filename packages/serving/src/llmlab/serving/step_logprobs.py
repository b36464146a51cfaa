"""A step's log-probabilities (``RequestOptions``), from the model's own logits: a prompt
token's from the rows prefill keeps for requests that ask, a generated token's from the row it
was chosen from. A failure (or an injected ``logprobs`` fault) fails its request alone
(through ``fail``, the engine's)."""

from __future__ import annotations

from typing import Any

from llmlab.serving.faults import fire
from llmlab.serving.logprobs import token_logprobs
from llmlab.serving.request_outputs import TrackedRequest
from llmlab.serving.scheduler import Chunk
from llmlab.serving.sequence import Sequence
from llmlab.serving.step_grammar import Fail


def wants_prompt_rows(chunk: Chunk) -> bool:
    """Whether ``chunk`` computes prompt positions whose logits give a prompt token's
    log-probability that its request asked for and does not have yet."""
    request = chunk.seq.request
    return request.needs_prompt_logits and chunk.start < request.num_prompt_tokens - 1


def record_prompt_logprobs(
    chunks: list[Chunk],
    every_row: set[int],
    logits: Any,
    failed: dict,
    tracked: dict[str, TrackedRequest],
    fail: Fail,
) -> Any:
    """Record the prompt tokens' log-probabilities from the rows kept for them (the row of
    position ``p`` gives token ``p + 1``'s); return the rows of the chunks that complete
    their sequence, one each, in order (what the step samples from)."""
    completing: list[int] = []
    r = 0
    for i, chunk in enumerate(chunks):
        if i not in every_row:
            if chunk.completes:
                completing.append(r)
                r += 1
            continue
        first, r = r, r + chunk.num_tokens
        if chunk.completes:
            completing.append(r - 1)
        request = chunk.seq.request
        rid = request.request_id
        if rid in failed or rid not in tracked:
            continue
        known = len(request.prompt_logprobs)  # tokens before `known` have theirs
        start = max(chunk.start, known - 1)
        stop = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
        if start >= stop:
            continue
        try:
            fire("logprobs", tracked[rid].rules.fault)
            rows = logits[first + start - chunk.start : first + stop - chunk.start]
            tokens = request.prompt_ids[start + 1 : stop + 1]
            top = [request.options.prompt_logprobs] * len(tokens)
            request.prompt_logprobs += token_logprobs(rows, tokens, top)
        except Exception as err:
            failed[rid] = fail(rid, "logprobs", err)
    return logits if len(completing) == logits.shape[0] else logits[completing]


def record_token_logprobs(
    seqs: list[Sequence],
    rows: list[int],
    tokens: list,
    raw: Any,
    failed: dict,
    tracked: dict[str, TrackedRequest],
    fail: Fail,
) -> None:
    """Each chosen token's log-probability (and its step's most likely tokens) for the
    sequences whose request asks, from the model's logits ``raw`` (row ``rows[i]`` for
    ``seqs[i]``)."""
    want = []
    for i, seq in enumerate(seqs):
        rid = seq.request.request_id
        if seq.request.options.logprobs is None or rid in failed:
            continue
        try:
            fire("logprobs", tracked[rid].rules.fault)
        except Exception as err:
            failed[rid] = fail(rid, "logprobs", err)
            continue
        want.append(i)
    want = [i for i in want if seqs[i].request.request_id not in failed]
    if not want:
        return
    try:
        computed = token_logprobs(
            raw[[rows[i] for i in want]],
            [tokens[i] for i in want],
            [seqs[i].request.options.logprobs for i in want],
        )
    except Exception as err:
        for rid in dict.fromkeys(seqs[i].request.request_id for i in want):
            failed[rid] = fail(rid, "logprobs", err)
        return
    for i, logprob in zip(want, computed):
        seqs[i].logprobs.append(logprob)
