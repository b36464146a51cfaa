"""The block manager: which KV blocks each sequence owns, shared prefixes, copy-on-write.

The KV pool is ``num_blocks`` blocks of ``block_size`` token slots (the tensors live in the
model runner; this module only does the bookkeeping, in plain Python). A sequence's *block
table* lists its blocks in order, so token ``p`` lives in block ``table[p // block_size]``.
Blocks are handed out only as a sequence grows, and come back when it finishes, is cancelled or
is preempted.

**Prefix caching.** A block that is full is identified by a hash chained over its tokens and
the previous block's hash, ``h_i = hash((h_{i-1}, tokens_i))``, so equal hashes mean equal
*prefixes*, not just equal blocks. A new sequence whose first blocks' hashes are known reuses
those blocks instead of recomputing them (the tokens are compared too, so a hash collision can
never hand out wrong keys). The chain starts from the sequence's ``cache_salt`` (its LoRA
adapter's name, None for the base): the same tokens under another adapter have other keys and
values, so they never share blocks. Blocks are reference-counted: a block shared by k sequences has
``ref_count == k``. A block whose count drops to 0 goes to the back of the free queue but keeps
its hash, so a later request can still hit it; it is forgotten only when it is handed out again:
from the front of the queue (least recently freed first, as in vLLM), or out of turn as the block
right after a growing sequence's last one. That one exception keeps a sequence's blocks one run
of the pool where it can (after a prefix hit too), so attention on a CPU reads its keys as one
slice instead of gathering them (gathering at every layer and step made a repeated 150-token
GPT-2 124M request at batch 1 take 3.83 s instead of 3.63); it costs at most the cached contents
of that one block.

**Copy-on-write.** ``fork`` gives a child sequence the parent's whole table (every block's count
goes up). Full blocks are never written again, so sharing them is free; the one block that may
still be written, a partial last block, is copied the first time a sequence that shares it
appends: the sequence gets a fresh block, the runner copies the keys and values across before
the next forward (``pending_copies``), and the shared block loses one reference.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol


class HasBlocks(Protocol):
    """What the block manager reads and writes on a sequence."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    block_hashes: list[int]  # chained keys of the sequence's full computed blocks, in order
    cache_salt: str | None  # where its chain starts (its adapter): None for the base model


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    tokens: tuple[int, ...] = ()  # the tokens the hash covers (checked on every cache hit)


@dataclass
class BlockStats:
    """Counts for metrics and tests: ``free + used == total`` always."""

    total: int
    free: int
    cached: int  # registered in the prefix cache (free or not)
    hits: int = 0  # blocks reused from the prefix cache since start
    queries: int = 0  # full prompt blocks looked up since start
    copies: int = 0  # copy-on-write copies since start
    used: int = field(init=False)

    def __post_init__(self) -> None:
        self.used = self.total - self.free


def chain_hash(parent: int | str | None, tokens: tuple[int, ...]) -> int:
    """The prefix cache key of a full block: its tokens chained to its parent's key (the first
    block's parent: the sequence's ``cache_salt``)."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache: dict[int, int] = {}  # chained hash -> block id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the runner, in order
        self._hits = self._queries = self._copies = 0

    # ------------------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> BlockStats:
        return BlockStats(
            total=len(self.blocks),
            free=self.num_free,
            cached=len(self.cache),
            hits=self._hits,
            queries=self._queries,
            copies=self._copies,
        )

    def cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Blocks of the prefix cache holding the longest run of ``token_ids``' full blocks.

        At least one token is always left to compute (its logits give the next token), so a
        prompt made only of cached blocks hits all but its last block. ``salt``: the
        sequence's ``cache_salt`` (its chain's start).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | str | None = salt
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self.cache.get(parent)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
        return hits

    # ---------------------------------------------------------------------- allocation
    def allocate(self, seq: HasBlocks, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make room for ``seq``'s next ``num_new_tokens`` tokens; False (nothing changed) if
        the free blocks do not suffice.

        ``cached``: prefix-cache blocks for a sequence that holds none yet (from
        :meth:`cached_prefix`); they become its first blocks and count as computed.
        """
        fresh = not seq.block_table
        if cached and not fresh:
            raise ValueError("cached prefix blocks are only for a sequence without blocks")
        computed = seq.num_computed + len(cached) * self.block_size
        table_len = len(seq.block_table) + len(cached)
        needed = max(0, self.blocks_for(computed + num_new_tokens) - table_len)
        cow = num_new_tokens > 0 and self._needs_copy(seq)
        # a cached block with no owner sits in the free queue: taking it uses up a free block
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if needed + cow + revived > self.num_free:
            return False
        if fresh and self.enable_prefix_caching:
            self._queries += (len(seq.token_ids) - 1) // self.block_size
            self._hits += len(cached)
        for block_id in cached:
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed = computed
        if cow:
            self._copy_last_block(seq)
        for _ in range(needed):
            seq.block_table.append(self._new_block(after=seq.block_table[-1:]))
        return True

    def free(self, seq: HasBlocks) -> None:
        """Return ``seq``'s blocks; the last ones first go to the back of the queue, so a
        prefix's head outlives its tail in the cache."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0

    def fork(self, parent: HasBlocks, child: HasBlocks) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write for a partial last one)."""
        if child.block_table:
            raise ValueError("fork: the child already owns blocks")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table.extend(parent.block_table)
        child.block_hashes.extend(parent.block_hashes)
        child.num_computed = parent.num_computed

    def register_full_blocks(self, seq: HasBlocks) -> None:
        """Hash the blocks of ``seq`` that its computed tokens filled since the last call and
        add them to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt, tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and key not in self.cache:  # a duplicate stays private
                block.hash, block.tokens = key, tokens
                self.cache[key] = block.block_id

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies the runner must do before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---------------------------------------------------------------------- invariants
    def check(self, sequences: list[HasBlocks]) -> None:
        """Assert the books balance for the live ``sequences`` (tests and debugging)."""
        owners: dict[int, int] = {}
        for seq in sequences:
            for block_id in seq.block_table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in self.blocks:
            want = owners.get(block.block_id, 0)
            if block.ref_count != want:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, owned by {want}"
                )
            if (block.ref_count == 0) != (block.block_id in self.free_queue):
                raise AssertionError(f"block {block.block_id}: free queue and count disagree")
        for key, block_id in self.cache.items():
            if self.blocks[block_id].hash != key:
                raise AssertionError(f"prefix cache entry {key} points at a block without it")

    # ------------------------------------------------------------------------ helpers
    def _needs_copy(self, seq: HasBlocks) -> bool:
        """Whether the next token lands in a partial last block that others share."""
        if not seq.block_table or seq.num_computed % self.block_size == 0:
            return False
        if seq.num_computed // self.block_size != len(seq.block_table) - 1:
            return False  # the partial block is not the last one (room was allocated ahead)
        return self.blocks[seq.block_table[-1]].ref_count > 1

    def _copy_last_block(self, seq: HasBlocks) -> None:
        src = seq.block_table[-1]
        dst = self._new_block()
        self.blocks[src].ref_count -= 1  # still > 0: another sequence keeps it
        seq.block_table[-1] = dst
        self.pending_copies.append((src, dst))
        self._copies += 1

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _new_block(self, after: list[int] = ()) -> int:
        """A free block for a sequence whose table ends with ``after`` (empty: none yet): the
        block right after that one where it is free, so the sequence's blocks stay one run of the
        pool (attention on a CPU then reads its keys as one slice instead of gathering them,
        ``llmlab.kernels.paged_attention``); else the front of the free queue. A cached block
        taken either way is evicted."""
        following = after[0] + 1 if after else None
        if following is not None and following in self.free_queue:
            del self.free_queue[following]
            block_id = following
        else:
            block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its contents are about to be overwritten
            del self.cache[block.hash]
            block.hash, block.tokens = None, ()
        block.ref_count = 1
        return block_id
