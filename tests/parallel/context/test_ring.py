"""Ring attention on 2, 3 and 4 gloo ranks against SDPA on the unsplit sequence.

Oracle: ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal``, ``enable_gqa``) and
its autograd, run by every rank on the whole sequence in the same dtype; each rank compares its
output and its dq/dk/dv with its own tokens' rows of the oracle's. Tolerances: fp64 1e-12,
fp32 1e-5; bf16 (checked against the fp64 oracle) within twice bf16 SDPA's own error plus 4e-3.
Each rank also checks that the bytes it sent, by purpose, equal ``cp_bytes``' formula exactly.

Every case of one degree runs in one spawn (a spawn costs seconds); the default suite runs the
full matrix at degree 2 and two cases at degree 4, the ``slow`` marker the full matrix at 3 and 4.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

from llmlab.parallel.context import ContextParallel, cp_bytes
from llmlab.parallel.context.ring import DKV_BACKWARD, KV_BACKWARD, KV_FORWARD
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

TOL = {"float64": 1e-12, "float32": 1e-5}
B, D = 2, 16

# (dtype, causal, heads, kv_heads, scheme, backend)
MATRIX = [
    (dtype, causal, heads, kv_heads, scheme, "flash")
    for dtype, causal, (heads, kv_heads), scheme in itertools.product(
        ("float64", "float32"), (True, False), ((4, 4), (4, 2)), ("zigzag", "contiguous")
    )
]
EXTRA = [  # the plain-torch block kernels (the CUDA path) and bf16
    ("float64", True, 4, 2, "zigzag", "blocked"),
    ("float32", False, 4, 4, "contiguous", "blocked"),
    ("bfloat16", True, 4, 2, "zigzag", "flash"),
    ("bfloat16", True, 4, 4, "contiguous", "blocked"),
]
DEFAULT_DEGREE_4 = [("float64", True, 4, 2, "zigzag", "flash"),
                    ("float32", True, 4, 4, "contiguous", "flash")]  # fmt: skip


def _inputs(case, T: int) -> list[torch.Tensor]:
    dtype, _, heads, kv_heads, _, _ = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))  # same on every rank
    shapes = [(B, heads, T, D), (B, kv_heads, T, D), (B, kv_heads, T, D), (B, heads, T, D)]
    return [
        torch.randn(s, generator=g, dtype=torch.float64).to(getattr(torch, dtype)) for s in shapes
    ]


def _sdpa(q, k, v, do, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def _check_case(rank: int, world: int, case, failures: list[str]) -> None:
    dtype, causal, _, kv_heads, scheme, backend = case
    T = 8 * world
    q, k, v, do = _inputs(case, T)
    cp = ContextParallel(scheme=scheme, backend=backend)
    mine = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine, causal=causal)
    out.backward(cp.shard(do, dim=2))
    ours = [out.detach()] + [t.grad for t in mine]
    names = ("out", "dq", "dk", "dv")
    if dtype == "bfloat16":
        exact = _sdpa(*(t.double() for t in (q, k, v, do)), causal)
        theirs = _sdpa(q, k, v, do, causal)
        for name, a, b, ref in zip(names, ours, theirs, exact):
            ref = cp.shard(ref, dim=2)
            err = (a.double() - ref).abs().max().item()
            bound = 2 * (cp.shard(b, dim=2).double() - ref).abs().max().item() + 4e-3
            if err > bound:
                failures.append(f"{case} rank {rank}: {name} bf16 error {err:.3g} > {bound:.3g}")
    else:
        for name, a, b in zip(names, ours, _sdpa(q, k, v, do, causal)):
            err = (a - cp.shard(b, dim=2)).abs().max().item()
            if err > TOL[dtype]:
                failures.append(f"{case} rank {rank}: {name} differs from SDPA by {err:.3g}")
    want = {
        KV_FORWARD: cp_bytes(B, kv_heads, T, D, world, getattr(torch, dtype), backward=False),
        KV_BACKWARD: cp_bytes(B, kv_heads, T, D, world, getattr(torch, dtype), backward=False),
    }
    want[DKV_BACKWARD] = (
        cp_bytes(B, kv_heads, T, D, world, getattr(torch, dtype)) - 2 * want[KV_FORWARD]
    )
    if cp.stats.by_op != want:
        failures.append(f"{case} rank {rank}: sent {cp.stats.by_op}, cp_bytes says {want}")


def check_ring(rank: int, world: int, cases: list, edges: bool = False) -> list[str]:
    failures: list[str] = []
    for case in cases:
        _check_case(rank, world, case, failures)
    if edges:
        _check_edges(world, failures)
    return failures


def _check_edges(world: int, failures: list[str]) -> None:
    """Serialised transfers give the very same numbers; bad inputs are refused by name."""
    q, k, v, do = _inputs(("float64", True, 4, 2, "zigzag", "flash"), 8 * world)
    results = []
    for overlap in (True, False):
        cp = ContextParallel(overlap=overlap)
        mine = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
        out = cp.attention(*mine)
        out.backward(cp.shard(do, dim=2))
        results.append([out.detach()] + [t.grad for t in mine])
    if not all(torch.equal(a, b) for a, b in zip(*results)):
        failures.append("overlap=False changed the result")
    cp = ContextParallel()
    local = [cp.shard(t, dim=2) for t in (q, k, v)]
    refusals = {
        "no attention dropout": lambda: cp.attention(*local, dropout_p=0.1),
        "local sequence length 3 is not divisible by the 2 pieces": lambda: cp.attention(
            *(t[:, :, :3] for t in local)
        ),
        "3 key/value heads do not divide 4 query heads": lambda: cp.attention(
            local[0], *(torch.cat([t, t[:, :1]], 1) for t in local[1:])
        ),
    }
    for expected, call in refusals.items():
        try:
            call()
            failures.append(f"not refused: {expected}")
        except ValueError as err:
            if expected not in str(err):
                failures.append(f"refused with {err!r}, expected {expected!r}")


def _assert_clean(results: list[list[str]]) -> None:
    failures = [f for rank in results for f in rank]
    assert not failures, "\n".join(failures)


def test_ring_attention_equals_sdpa_on_two_ranks():
    _assert_clean(run_distributed(check_ring, 2, MATRIX + EXTRA, True))


def test_ring_attention_equals_sdpa_on_four_ranks():
    _assert_clean(run_distributed(check_ring, 4, DEFAULT_DEGREE_4))


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_ring_attention_full_matrix(world):
    _assert_clean(run_distributed(check_ring, world, MATRIX + EXTRA))
