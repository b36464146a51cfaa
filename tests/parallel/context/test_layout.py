"""The context-parallel splits, their block plans and the per-rank attention work (no processes).

Oracles: the causal mask itself (``key position <= query position``, the mask SDPA's
``is_causal`` applies) and brute-force counting over it; exact integers, no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.parallel.context import (
    SCHEMES,
    ContextLayout,
    attention_work,
    block_plan,
    work_imbalance,
)

DEGREES = (1, 2, 3, 4)


def test_zigzag_gives_each_rank_a_head_piece_and_a_tail_piece():
    layout = ContextLayout(2)  # zigzag is the default
    assert layout.scheme == "zigzag"
    assert layout.indices(0, 8).tolist() == [0, 1, 6, 7]
    assert layout.indices(1, 8).tolist() == [2, 3, 4, 5]
    assert ContextLayout(2, "contiguous").indices(1, 8).tolist() == [4, 5, 6, 7]
    assert layout.positions(0, 8).shape == (1, 4)  # the models' (1, T) position ids


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("degree", DEGREES)
def test_shard_then_unshard_is_the_identity_and_parts_partition_the_sequence(scheme, degree):
    layout = ContextLayout(degree, scheme)
    T = 4 * layout.num_pieces
    x = torch.arange(2 * T * 3).view(2, T, 3)
    parts = [layout.shard(x, r, dim=1) for r in range(degree)]
    assert all(p.shape == (2, T // degree, 3) for p in parts)
    assert torch.equal(layout.unshard(parts, dim=1), x)
    seen = torch.cat([layout.indices(r, T) for r in range(degree)]).sort().values
    assert torch.equal(seen, torch.arange(T))
    for r in range(degree):  # positions are the global indices of the rank's tokens
        assert torch.equal(layout.shard(x, r)[0, :, 0], layout.positions(r, T)[0] * 3)


def _covered(layout: ContextLayout, rank: int, source: int, T: int, causal: bool) -> torch.Tensor:
    """How many times the plan scores each (local query, held key) pair."""
    local = T // layout.degree
    count = torch.zeros(local, local, dtype=torch.int64)
    for block in block_plan(layout, rank, source, T, causal):
        q0, q1, k0, k1 = block.q.start, block.q.stop, block.k.start, block.k.stop
        if block.diagonal:
            assert q1 - q0 == k1 - k0
            count[q0:q1, k0:k1] += torch.ones(q1 - q0, k1 - k0, dtype=torch.int64).tril()
        else:
            count[q0:q1, k0:k1] += 1
    return count


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("degree", DEGREES)
def test_block_plan_scores_exactly_the_pairs_the_mask_allows_once(degree, scheme, causal):
    layout = ContextLayout(degree, scheme)
    T = 3 * layout.num_pieces
    for rank in range(degree):
        q_pos = layout.indices(rank, T)
        for source in range(degree):
            k_pos = layout.indices(source, T)
            allowed = k_pos[None, :] <= q_pos[:, None]
            if not causal:
                allowed = torch.ones_like(allowed)
            assert torch.equal(_covered(layout, rank, source, T, causal), allowed.long())


@pytest.mark.parametrize("degree", DEGREES)
def test_work_per_rank_contiguous_grows_zigzag_is_flat(degree):
    T = 8 * 2 * degree
    P = T // degree
    contiguous = attention_work(ContextLayout(degree, "contiguous"), T)
    assert contiguous == [r * P * P + P * (P + 1) // 2 for r in range(degree)]
    zigzag = attention_work(ContextLayout(degree, "zigzag"), T)
    assert zigzag == [T * (T + 1) // (2 * degree)] * degree
    assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2  # the causal lower triangle
    # max / min: about 2N - 1 contiguous (exactly 1 + 2(N-1)P/(P+1)), 1 zigzag
    assert work_imbalance(ContextLayout(degree, "contiguous"), T) == pytest.approx(
        1 + 2 * (degree - 1) * P / (P + 1)
    )
    assert work_imbalance(ContextLayout(degree), T) == 1.0
    non_causal = attention_work(ContextLayout(degree), T, causal=False)
    assert non_causal == [T * T // degree] * degree


def test_lengths_that_do_not_split_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 × context = 8"):
        ContextLayout(4).check_length(12)
    with pytest.raises(ValueError, match=r"use a multiple of 3, e\.g\. 9 or 12"):
        ContextLayout(3, "contiguous").check_length(10)
    with pytest.raises(ValueError, match="unknown context-parallel split 'ring'"):
        ContextLayout(2, "ring")
    with pytest.raises(ValueError, match="positive integer, got 0"):
        ContextLayout(0)
    with pytest.raises(ValueError, match=r"rank 2 is not in the context group; valid: 0\.\.1"):
        ContextLayout(2).pieces(2)
