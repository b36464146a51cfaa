"""The scheduler alone, driven by a fake forward (no model): the token budget, chunked prefill
next to decoding sequences, FIFO admission, newest-first preemption and recomputation, and that
every request finishes (no starvation) with all blocks back in the pool."""

from __future__ import annotations

import pytest

from llmlab.decoding import GenerationConfig
from llmlab.serving.config import EngineConfig
from llmlab.serving.scheduler import Scheduler, SchedulerOutput
from llmlab.serving.sequence import Request, Sequence


def config(**kw) -> EngineConfig:
    base = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16,
                max_model_len=128)  # fmt: skip
    return EngineConfig(**{**base, **kw})


def add(s: Scheduler, order: int, prompt_len: int, new_tokens: int) -> Sequence:
    request = Request(f"r{order}", [order % 7 + 1] * prompt_len,
                      GenerationConfig(max_new_tokens=new_tokens), order)  # fmt: skip
    request.forked = True  # one sequence
    seq = request.new_sequence(0, request.prompt_ids)
    s.add(seq)
    return seq


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, 'compute', append a token to every completed sequence, retire finished ones."""
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    s.after_forward(out)
    for chunk in out.chunks:
        if chunk.completes:
            seq = chunk.seq
            seq.token_ids.append(1000 + len(seq.output_ids))
            if len(seq.output_ids) == seq.request.config.max_new_tokens:
                s.finish(seq, "length")
    s.blocks.check(s.running + s.waiting)
    return out


def run(s: Scheduler, max_steps: int = 500) -> int:
    for n in range(max_steps):
        if not s.has_work:
            return n
        step(s)
    raise AssertionError("the scheduler did not drain")


def test_a_long_prompt_is_chunked_and_never_stalls_decoding_sequences():
    s = Scheduler(config())
    decoders = [add(s, i, 3, 40) for i in range(3)]
    step(s)  # the three short prompts
    long = add(s, 3, 100, 2)
    chunks = []
    while long.num_computed < 100:
        out = step(s)
        mine = [c.num_tokens for c in out.chunks if c.seq is long]
        chunks += mine
        assert all(any(c.seq is d and c.num_tokens == 1 for c in out.chunks) for d in decoders)
    assert sum(chunks) == 100 and max(chunks) == 16 - 3  # the budget minus one per decoder
    assert len(long.output_ids) == 1  # the last chunk completed the prompt: a token came out


def test_admission_is_first_come_first_served_without_skipping():
    s = Scheduler(config(num_blocks=10, max_num_batched_tokens=64, max_model_len=40))
    first = add(s, 0, 30, 4)  # 8 blocks
    big = add(s, 1, 20, 4)  # 5 blocks: does not fit next to the first
    small = add(s, 2, 2, 4)  # would fit, but arrived later
    step(s)
    assert s.running == [first] and s.waiting == [big, small]
    run(s)
    assert all(len(q.output_ids) == 4 for q in (first, big, small))


def test_running_out_of_blocks_preempts_the_newest_which_resumes_first():
    s = Scheduler(config(num_blocks=8, max_num_batched_tokens=32, max_model_len=20))
    seqs = [add(s, i, 7, 12) for i in range(4)]  # 2 blocks each at first, 5 at the end
    preempted = []
    while s.has_work:
        out = step(s)
        preempted += out.preempted
        for victim in out.preempted:  # the newest running sequence, sent to the front
            assert victim.num_computed == 0 and victim.block_table == []
            assert all(r.order < victim.order for r in s.running)
            assert s.waiting[0].order <= victim.order
    assert preempted and seqs[0] not in preempted  # the oldest is never the victim
    assert all(q.output_ids == [1000 + i for i in range(12)] for q in seqs)
    assert s.num_preemptions == len(preempted)
    assert s.blocks.num_free == 8 and all(b.ref_count == 0 for b in s.blocks.blocks)


def test_a_step_that_preempts_admits_nobody():
    s = Scheduler(config(num_blocks=4, max_num_batched_tokens=32, max_model_len=12))
    add(s, 0, 4, 8)
    add(s, 1, 4, 8)
    step(s)
    late = add(s, 2, 1, 1)
    while not (out := step(s)).preempted:
        pass
    assert late not in [c.seq for c in out.chunks]
    run(s)


def test_max_num_seqs_counts_the_sequences_a_request_will_fork_into():
    s = Scheduler(config(max_num_seqs=4))
    request = Request(
        "n3", [1, 2, 3], GenerationConfig(max_new_tokens=2, num_return_sequences=3), 0
    )
    s.add(request.new_sequence(0, request.prompt_ids))
    other = Request("n2", [4, 5], GenerationConfig(max_new_tokens=2, num_return_sequences=2), 1)
    s.add(other.new_sequence(0, other.prompt_ids))
    step(s)
    assert len(s.running) == 1 and len(s.waiting) == 1  # 3 seats taken + 2 would exceed 4


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = Scheduler(config(enable_chunked_prefill=False, max_num_batched_tokens=128))
    a = add(s, 0, 100, 3)
    b = add(s, 1, 40, 3)
    out = step(s)
    assert [c.num_tokens for c in out.chunks] == [100]  # b's 40 do not fit in the 28 left
    out = step(s)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 40)]


def test_engine_config_names_the_numbers_that_disagree():
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be >= max_num_seqs=8"):
        config(max_num_batched_tokens=4).validate()
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        config(num_blocks=10).validate()
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 must be >= max_model_len=128"):
        config(enable_chunked_prefill=False).validate()
    with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens"):
        EngineConfig(max_model_len=128).resolved(64)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        config(block_size=0).validate()
    resolved = EngineConfig(kv_cache_tokens=100, block_size=16).resolved(64)
    assert resolved.num_blocks == 7 and resolved.max_model_len == 64


def test_draft_slots_come_from_the_budget_and_free_blocks_and_never_preempt():
    """Speculation's lookahead (``Sequence.lookahead``): granted after every running sequence
    has its own token, from the budget and the free blocks left; nobody is preempted for
    drafts and no draft takes a block a sequence's own token needs."""
    s = Scheduler(config(num_blocks=4, max_num_batched_tokens=12, max_model_len=16))
    a, b = add(s, 0, 7, 20), add(s, 1, 4, 20)
    step(s)  # both prompts: blocks 2 + 1, one free; a at 8 tokens (7 computed), b at 5 (4)
    a.lookahead = b.lookahead = 6
    out = s.schedule()
    # b's own token (position 4) takes the free block; a's block 2 is full: no room for drafts;
    # b's new block has 3 slots left after its token: 3 drafts
    assert [(c.seq, c.num_tokens, c.lookahead) for c in out.chunks] == [(a, 1, 0), (b, 1, 3)]
    assert not out.preempted and s.num_preemptions == 0 and s.blocks.num_free == 0
    s.after_forward(out)
    for seq in (a, b):
        seq.token_ids.append(0)
    b.lookahead = 12
    s.finish(a, "length")  # two blocks free again: b's 6 tokens + 10 drafts fill all four
    (chunk,) = s.schedule().chunks
    assert (chunk.num_tokens, chunk.lookahead) == (1, 10) and len(b.block_table) == 4
