"""A step's structured output: the next-token masks of the sequences that follow a grammar,
computed once the forward has been called (an accelerator runs it meanwhile), applied to their
rows before any token is chosen, and each grammar advanced by its chosen token. A grammar that
errs fails its request alone (through ``fail``, the engine's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmlab.serving.faults import fire
from llmlab.serving.request_outputs import RequestOutput, TrackedRequest
from llmlab.serving.scheduler import Chunk
from llmlab.serving.sequence import Sequence
from llmlab.serving.structured import Grammars

Fail = Callable[[str, str, BaseException], "RequestOutput | None"]


def masked_sequences(
    chunks: list[Chunk], tracked: dict[str, TrackedRequest]
) -> tuple[dict[Sequence, int], dict[str, Exception]]:
    """The sequences this step samples that follow a grammar, each with its row of the masks
    (``sequence -> row``), and the requests whose grammar stage failed already."""
    masked: dict[Sequence, int] = {}
    errors: dict[str, Exception] = {}
    for chunk in chunks:
        seq = chunk.seq
        if not chunk.completes or seq.grammar is None:
            continue
        rid = seq.request.request_id
        try:
            fire("grammar", tracked[rid].rules.fault)
        except Exception as err:
            errors[rid] = err
            continue
        masked[seq] = len(masked)
    return masked, errors


def compute_masks(
    masked: dict[Sequence, int],
    errors: dict[str, Exception],
    grammars: Grammars,
    failed: dict,
    fail: Fail,
) -> Any:
    """The masks of the ``masked`` sequences ((rows, vocab) booleans, True where a token is
    refused; None if none); a request whose grammar failed ends here (the others' masks
    stand)."""
    for rid, err in errors.items():
        failed[rid] = fail(rid, "grammar", err)
    if not masked:
        return None
    try:
        refused = grammars.masks([seq.grammar for seq in masked])
    except Exception as err:
        for seq in masked:
            rid = seq.request.request_id
            if rid not in failed:
                failed[rid] = fail(rid, "grammar", err)
        return None
    for seq in masked:
        rid = seq.request.request_id
        if seq.grammar.is_error() and rid not in failed:
            failed[rid] = fail(rid, "grammar", ValueError(seq.grammar.get_error()))
    return refused


def apply_masks(logits: Any, refused: Any, grammar_rows: list[int | None]) -> Any:
    """``logits`` with ``-inf`` wherever row ``i``'s grammar (row ``grammar_rows[i]`` of
    ``refused``) refuses a token; rows with no grammar unchanged. A new tensor: the step's raw
    logits stay the model's (log-probabilities are reported from them)."""
    pick = [i for i, j in enumerate(grammar_rows) if j is not None]
    if not pick:
        return logits
    if grammar_rows != list(range(len(grammar_rows))) or refused.shape[0] != len(pick):
        full = torch.zeros(logits.shape, dtype=torch.bool)
        full[pick] = refused[[grammar_rows[i] for i in pick]]
        refused = full
    return logits.masked_fill(refused.to(logits.device, non_blocking=True), float("-inf"))


def advance_grammar(matcher: Any, token: int) -> bool:
    """Advance a sequence's grammar by its chosen ``token``; whether the grammar is then
    complete (it takes no more tokens). A token the grammar refuses raises."""
    if not matcher.consume_token(token):
        raise ValueError(f"the grammar refused token {token}: {matcher.get_error()}")
    return matcher.is_stopped()
