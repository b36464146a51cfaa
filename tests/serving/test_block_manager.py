"""The block manager alone (no model, no tensors): allocation on demand, the chained-hash prefix
cache, reference counts, eviction order and copy-on-write; and a property test that random
sequences of operations never unbalance the books."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmlab.serving.block_manager import BlockManager, chain_hash


@dataclass(eq=False)
class Seq:
    token_ids: list[int]
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    cache_salt: str | None = None


def prefill(bm: BlockManager, seq: Seq) -> None:
    cached = bm.cached_prefix(seq.token_ids)
    n = len(seq.token_ids) - len(cached) * bm.block_size
    assert bm.allocate(seq, n, cached)
    seq.num_computed += n
    bm.register_full_blocks(seq)


def test_blocks_are_allocated_as_the_sequence_grows_and_all_come_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(list(range(6)))
    prefill(bm, seq)
    assert len(seq.block_table) == 2 and bm.num_free == 6  # 6 tokens: 2 blocks, no more
    for t in range(6, 13):  # decode: a new block exactly when a block fills up
        seq.token_ids.append(t)
        assert bm.allocate(seq, 1)
        seq.num_computed += 1
        bm.register_full_blocks(seq)
        assert len(seq.block_table) == -(-(t + 1) // 4)
    bm.check([seq])
    bm.free(seq)
    assert bm.num_free == 8 and seq.block_table == []
    bm.check([])


def test_allocation_refuses_without_changing_anything_when_blocks_run_out():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = Seq(list(range(8))), Seq(list(range(100, 108)))
    prefill(bm, a)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_free == 1
    bm.check([a, b])


def test_a_shared_prefix_is_computed_once_and_reference_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    system = [7, 7, 7, 7, 8, 8, 8, 8]  # two full blocks shared by both prompts
    a, b = Seq([*system, 1, 2]), Seq([*system, 3])
    prefill(bm, a)
    assert bm.cached_prefix(b.token_ids) == a.block_table[:2]
    prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.stats().hits == 2
    bm.check([a, b])
    bm.free(a)
    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.num_free == 10


def test_the_hash_is_chained_so_equal_blocks_after_different_prefixes_do_not_match():
    bm = BlockManager(num_blocks=10, block_size=2)
    prefill(bm, Seq([1, 2, 3, 4, 5]))
    assert len(bm.cached_prefix([9, 9, 3, 4, 5])) == 0  # block [3, 4] after a different block
    assert len(bm.cached_prefix([1, 2, 3, 4, 6])) == 2
    assert chain_hash(None, (1, 2)) != chain_hash(chain_hash(None, (9, 9)), (1, 2))


def test_a_prompt_made_of_cached_blocks_still_computes_its_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    prefill(bm, Seq(list(range(8))))
    again = Seq(list(range(8)))
    cached = bm.cached_prefix(again.token_ids)
    assert len(cached) == 1  # the second block is recomputed: its last token's logits are due
    prefill(bm, again)
    assert again.num_computed == 8


def test_freed_cached_blocks_stay_hittable_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq([1, 2, 3, 4])
    prefill(bm, a)
    kept = list(a.block_table)
    bm.free(a)  # ref 0, but still in the prefix cache
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == kept and bm.stats().cached == 2
    hit = Seq([1, 2, 3, 4, 5])
    prefill(bm, hit)  # revives both cached blocks (they leave the free queue)
    assert hit.block_table[:2] == kept and bm.num_free == 1
    bm.free(hit)
    # the tail of a freed sequence is evicted before its head: [3,4]'s block goes first
    fresh = Seq([9, 9, 9, 9, 9, 9])
    prefill(bm, fresh)
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == kept[:1]
    bm.check([fresh])


def test_fork_shares_every_block_and_the_partial_block_is_copied_on_write():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = Seq([1, 2, 3, 4, 5, 6])
    prefill(bm, parent)
    child = Seq(list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    parent.token_ids.append(10)
    child.token_ids.append(20)
    shared_tail = parent.block_table[1]
    assert bm.allocate(parent, 1)  # writes into the shared partial block: copy first
    assert parent.block_table[1] != shared_tail
    assert bm.take_copies() == [(shared_tail, parent.block_table[1])]
    assert bm.allocate(child, 1)  # now the only owner: writes in place
    assert child.block_table[1] == shared_tail and bm.take_copies() == []
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    bm.check([parent, child])


def test_a_full_shared_block_needs_no_copy():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = Seq([1, 2, 3, 4])
    prefill(bm, parent)
    child = Seq(list(parent.token_ids))
    bm.fork(parent, child)
    child.token_ids.append(5)
    assert bm.allocate(child, 1) and bm.take_copies() == []
    assert len(child.block_table) == 2 and child.block_table[0] == parent.block_table[0]


def test_cached_blocks_need_a_sequence_without_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq([1, 2, 3])
    prefill(bm, a)
    with pytest.raises(ValueError, match="only for a sequence without blocks"):
        bm.allocate(a, 1, [0])


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "grow", "free", "fork"]), st.integers(0, 7), st.integers(1, 9)
    ),
    max_size=40,
)


@given(ops)
def test_random_operations_keep_the_books_balanced(operations):
    bm = BlockManager(num_blocks=12, block_size=3)
    live: list[Seq] = []
    for op, pick, size in operations:
        if op == "new":
            seq = Seq([pick % 3] * size)  # few distinct prompts: the cache gets hits
            cached = bm.cached_prefix(seq.token_ids)
            n = len(seq.token_ids) - len(cached) * bm.block_size
            if bm.allocate(seq, n, cached):
                seq.num_computed += n
                bm.register_full_blocks(seq)
                live.append(seq)
        elif live and op == "grow":
            seq = live[pick % len(live)]
            seq.token_ids += [pick] * size
            if bm.allocate(seq, size):
                seq.num_computed += size
                bm.register_full_blocks(seq)
            else:
                del seq.token_ids[-size:]
        elif live and op == "free":
            bm.free(live.pop(pick % len(live)))
        elif live and op == "fork":
            child = Seq(list(live[pick % len(live)].token_ids))
            bm.fork(live[pick % len(live)], child)
            live.append(child)
        bm.take_copies()
        bm.check(live)
    for seq in live:
        bm.free(seq)
    bm.check([])
    assert bm.num_free == 12 and all(b.ref_count == 0 for b in bm.blocks)


def test_a_sequence_after_a_prefix_hit_continues_in_the_next_block():
    """The block after a sequence's last one is taken when free (its keys stay one slice of the
    pool for CPU attention), even out of the free queue's order and evicting what it cached;
    where that block is owned, the queue's front is taken."""
    bm = BlockManager(num_blocks=8, block_size=4)
    first = Seq([*range(8), 50, 51, 52, 53])  # 2 prompt blocks + 1 generated, all full
    prefill(bm, first)
    assert first.block_table == [0, 1, 2]
    bm.free(first)  # queue front: 3, 4, ... then 2, 1, 0 (last blocks freed first)
    again = Seq([*range(8), 60, 61])  # the same prompt, another continuation
    prefill(bm, again)
    assert again.block_table == [0, 1, 2]  # prefix hit on 0, 1; then block 2, not block 3
    assert bm.stats().cached == 2  # block 2's old contents were evicted from the cache
    bm.check([again])
    other = Seq(list(range(100, 104)))
    prefill(bm, other)  # a fresh sequence starts at the queue's front
    assert other.block_table == [3]
    for t in range(10, 13):  # `again` outgrows block 2; block 3 is `other`'s: the front, 4
        again.token_ids.append(t)
        assert bm.allocate(again, 1)
        again.num_computed += 1
    assert again.block_table == [0, 1, 2, 4]
    bm.check([again, other])
