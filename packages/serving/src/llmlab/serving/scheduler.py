"""The scheduler: which sequences compute how many tokens in the next forward.

One step has a budget of ``max_num_batched_tokens`` tokens and is built in two passes:

1. **Running sequences, oldest first.** A decoding sequence needs one token; one still in its
   prompt needs the rest of it, capped so that every running sequence after it keeps one token
   of the budget (a long prompt advances in chunks -- *chunked prefill* -- and never stalls the
   sequences that are decoding). If the pool has no block for a sequence's tokens, the newest
   running sequence is *preempted*: its blocks are freed and it goes back to the front of the
   waiting queue, to be recomputed later (its tokens are kept; the prefix cache often gives its
   blocks straight back). If the newest is the sequence itself, the pass stops. Then the
   decoding sequences that speculate (``Sequence.lookahead``, ``llmlab.serving.speculation``)
   get slots for their drafts from what the budget and the free blocks have left.
2. **Waiting sequences, first come first served**, while the budget, the sequence limit and the
   free blocks allow, and only in a step that preempted nothing: a prompt starts with the
   blocks the prefix cache already holds, then its first chunk (a request that asks for its
   prompt's log-probabilities starts from nothing: cached blocks have no logits).

A running sequence with nothing to compute is a beam waiting for its siblings' logits
(``llmlab.serving.beam``): it is skipped, and stays preemptible like any other.

No starvation: admission is strictly FIFO (a sequence that does not fit blocks the ones behind
it), preemption always takes the newest, and a preempted sequence re-enters at the front, so
the oldest sequence only ever waits for older ones. ``EngineConfig`` guarantees the pool holds
one sequence of ``max_model_len`` tokens, so the oldest can always finish.

The scheduler knows sequences and blocks, not tensors: it is tested without a model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from llmlab.serving.block_manager import BlockManager
from llmlab.serving.config import EngineConfig
from llmlab.serving.sequence import Sequence, Status


@dataclass
class Chunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start``, computed in this step.

    Speculative decoding: ``lookahead`` more slots were booked for draft tokens; the engine
    appends the ``drafts`` it proposes to the sequence (and to ``num_tokens``) before the
    forward and takes them back after it, keeping those the target accepts."""

    seq: Sequence
    start: int
    num_tokens: int
    lookahead: int = 0
    drafts: int = 0

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a new token is due); its
        drafts aside, which the sequence holds only while the forward runs."""
        return self.start + self.num_tokens - self.drafts == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("Scheduler needs a resolved EngineConfig (EngineConfig.resolved)")
        config.validate()
        self.config = config
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: list[Sequence] = []  # by arrival order
        self.running: list[Sequence] = []  # by arrival order
        self.num_preemptions = 0

    # ------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def add_running(self, seq: Sequence) -> None:
        """A fork: ``seq`` already shares its parent's blocks."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.order)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` at once: its blocks go back to the pool this very step."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_computed == seq.num_tokens:  # a parked beam (llmlab.serving.beam)
                i += 1
                continue
            later = len(self.running) - i - 1  # each keeps one token of the budget
            n = min(seq.num_tokens - seq.num_computed, budget - later)
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
                i += 1
                continue
            break  # the sequence preempted itself: it was the newest
        budget = self._grant_lookahead(budget, out)
        if not out.preempted:
            budget = self._admit(budget, out)
        out.copies = self.blocks.take_copies()
        return out

    def _grant_lookahead(self, budget: int, out: SchedulerOutput) -> int:
        """Slots for the drafts of the decoding sequences that asked (``Sequence.lookahead``),
        oldest first, from what the budget and the free blocks have left once every running
        sequence has its own tokens: drafts never cost anyone a token or a block."""
        bs = self.config.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens
            room = (len(seq.block_table) + self.blocks.num_free) * bs - end
            extra = min(seq.lookahead, budget, room)
            if (
                extra > 0
                and chunk.completes
                and self.blocks.allocate(seq, end - seq.num_computed + extra)
            ):
                chunk.lookahead = extra
                budget -= extra
        return budget

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats_taken() + self._seats_needed(seq) > self.config.max_num_seqs:
                break
            # a request that wants its prompt's log-probabilities computes every prompt token
            # (a cached block has no logits to give them)
            needs_logits = seq.request.needs_prompt_logits
            salt = seq.cache_salt  # a LoRA adapter's blocks are its own
            cached = [] if needs_logits else self.blocks.cached_prefix(seq.token_ids, salt)
            need = seq.num_tokens - len(cached) * self.config.block_size
            if not self.config.enable_chunked_prefill and need > budget:
                break
            n = min(need, budget)
            if not self.blocks.allocate(seq, n, cached):
                break
            self.waiting.pop(0)
            self.add_running(seq)
            out.chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and send it back to wait; its tokens are recomputed later."""
        self.blocks.free(seq)
        seq.draft_computed = 0  # the draft's keys and values went with the blocks
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    @staticmethod
    def _seats_needed(seq: Sequence) -> int:
        """A request that has not forked yet will run ``num_sequences`` sequences."""
        return 1 if seq.request.forked else seq.request.num_sequences

    def _seats_taken(self) -> int:
        return sum(self._seats_needed(s) for s in self.running)

    def after_forward(self, out: SchedulerOutput) -> None:
        """The chunks' keys and values are in the pool now: count them, hash full blocks.
        Draft tokens are not counted: the engine counts those the target accepts."""
        for chunk in out.chunks:
            chunk.seq.num_computed = chunk.start + chunk.num_tokens - chunk.drafts
            self.blocks.register_full_blocks(chunk.seq)
