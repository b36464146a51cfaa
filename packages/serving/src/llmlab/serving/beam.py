"""Beam search in the engine: ``num_beams`` sequences that advance together, sharing KV blocks.

The search itself is ``llmlab.decoding.BeamSearch``, the same object ``llmlab.decoding``'s
``beam_search`` steps, so the engine picks the same hypotheses token for token. What the engine
adds is where the beams' keys and values live. A step of the search answers, for each new beam
``j``, its parent beam and its next token; a contiguous cache would copy the parent's whole KV
row into row ``j`` (``reorder``). Here a new beam is a new :class:`Sequence` *forked* from its
parent (``BlockManager.fork``: the child takes the parent's block table, every block's count + 1)
and then the old beams are freed. So:

* blocks that beams have in common -- the prompt, and every full block of a shared history --
  exist once, whatever ``num_beams`` is;
* a parent with no child gives its private blocks back to the pool at once;
* a partial last block shared by several children is copied only when a child writes its next
  token into it (copy-on-write, in ``BlockManager.allocate``); the last child to write keeps the
  original.

The beams of a request must all have their next-token logits before the search can step. In
the usual step they all decode together; a beam that got its logits while a sibling was
preempted waits *parked*: it stays in the running queue with nothing to compute (the scheduler
skips it) and may itself be preempted, which drops its logits -- it recomputes them later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmlab.decoding.beam import BeamSearch
from llmlab.serving.sequence import Request, Sequence, Status


class BeamGroup:
    """The beam search of one request and the sequences that hold its beams' KV blocks."""

    def __init__(self, request: Request, tokenizer: Any, device: torch.device | str) -> None:
        config = request.config  # deterministic: the engine refuses beam sampling
        prompt = torch.tensor([request.prompt_ids], device=device)
        self.request = request
        self.search = BeamSearch(prompt, config, tokenizer=tokenizer)
        self.num_beams = config.num_beams
        self.pending: dict[Sequence, Tensor] = {}  # next-token logits of the beams that have them
        self.steps = 0

    def add(self, seq: Sequence, logits: Tensor, scheduler: Any) -> bool:
        """Record ``seq``'s next-token ``logits`` (V,); step the search once every beam has
        them. Returns True when the search is done (``request.sequences`` are then its finished
        hypotheses)."""
        if not self.request.forked:  # the prompt: every beam starts from it (rows 1.. masked)
            beams, rows = [seq] * self.num_beams, logits.expand(self.num_beams, -1)
        else:
            self.pending[seq] = logits
            beams = self.request.sequences
            if not all(self._has_logits(b) for b in beams):
                return False
            rows = torch.stack([self.pending[b] for b in beams])
        parents = self.search.step(rows).tolist()
        tokens = self.search.last_tokens()[:, 0].tolist()
        self.pending.clear()
        self.steps += 1
        self.request.forked = True
        children = []
        if not self.search.done:
            for index, (parent, token) in enumerate(zip(parents, tokens)):
                child = Sequence(self.request, index, [*beams[parent].token_ids, token])
                scheduler.blocks.fork(beams[parent], child)
                children.append(child)
        for old in dict.fromkeys(beams):  # after the forks: shared blocks keep their count
            scheduler.finish(old, "beam")
        for child in children:
            scheduler.add_running(child)
        self.request.sequences = children
        if self.search.done:
            self.request.sequences = self._hypotheses()
        return self.search.done

    def abort(self, scheduler: Any) -> None:
        for seq in self.request.sequences:
            if not seq.is_finished:
                scheduler.finish(seq, "abort")
        self.pending.clear()

    def _has_logits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s recorded logits are still those of its last token (a beam
        preempted since has ``num_computed`` reset and computes them again)."""
        return (
            seq in self.pending
            and seq.status is Status.RUNNING
            and seq.num_computed == seq.num_tokens
        )

    def _hypotheses(self) -> list[Sequence]:
        """The ``num_return_sequences`` best finished hypotheses, best first, as finished
        sequences (they hold no blocks)."""
        request, config = self.request, self.request.config
        eos = set(config.eos_token_ids)
        out = []
        for index, tokens in enumerate(self.search.hypotheses()[0]):
            seq = Sequence(request, index, [*request.prompt_ids, *tokens], status=Status.FINISHED)
            full = len(tokens) >= config.max_new_tokens and not (tokens and tokens[-1] in eos)
            seq.finish_reason = "length" if full else "stop"
            out.append(seq)
        return out
