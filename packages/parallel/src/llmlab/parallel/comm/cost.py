"""The α-β (Hockney) cost model of each collective, the exact bytes each rank sends, and a fit.

Sending one message of n bytes costs ``α + n·β``: α is the per-message latency, β the inverse
bandwidth. An algorithm's time is (number of sequential message rounds)·α + (bytes on its
critical path)·β. For p ranks and an n-byte vector:

    ring all-reduce          2(p-1)·α + 2(p-1)/p · n·β
    recursive doubling       log2(p)·(α + n·β)          (p a power of two; else +2 rounds)
    reduce-then-broadcast    2⌈log2 p⌉·(α + n·β)
    ring all-gather          (p-1)·α + (p-1)/p · n·β     (n = size of the gathered output)
    ring reduce-scatter      (p-1)·α + (p-1)/p · n·β     (n = size of the input)
    tree broadcast           ⌈log2 p⌉·(α + n·β)

The reduction's arithmetic (a γ term) is ignored: on this machine it is far below the copy cost.
"""

from __future__ import annotations

import math

from llmlab.parallel.comm.chunks import chunk_sizes

ALGORITHMS = (
    "ring",
    "recursive_doubling",
    "reduce_broadcast",
    "all_gather",
    "reduce_scatter",
    "broadcast",
)


def _check(algorithm: str, p: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {list(ALGORITHMS)}")
    if p < 1:
        raise ValueError(f"group size must be >= 1, got {p}")


def _log2_ceil(p: int) -> int:
    return (p - 1).bit_length()


def predicted_time(algorithm: str, nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds the α-β model predicts for ``algorithm`` on an ``nbytes`` vector over p ranks."""
    _check(algorithm, p)
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta
    if algorithm == "recursive_doubling":
        q = 1 << (p.bit_length() - 1)
        rounds = int(math.log2(q)) + (2 if q != p else 0)
        return rounds * (alpha + nbytes * beta)
    if algorithm == "reduce_broadcast":
        return 2 * _log2_ceil(p) * (alpha + nbytes * beta)
    if algorithm in ("all_gather", "reduce_scatter"):
        return (p - 1) * alpha + (p - 1) / p * nbytes * beta
    return _log2_ceil(p) * (alpha + nbytes * beta)  # broadcast


def _tree_children(v: int, p: int) -> int:
    """Children of relative rank v in the binomial tree used by ``broadcast``."""
    mask = 1
    while mask < p and not v & mask:
        mask <<= 1
    children, mask = 0, mask >> 1
    while mask > 0:
        children += v + mask < p
        mask >>= 1
    return children


def elements_sent(algorithm: str, n: int, p: int, rank: int, root: int = 0) -> int:
    """Exactly how many elements ``rank`` sends (``n`` = vector length; for all-gather, the
    per-rank input length). Averaged over ranks, ring all-reduce gives 2(p-1)/p·n."""
    _check(algorithm, p)
    if p == 1 or n == 0:
        return 0
    sizes = chunk_sizes(n, p)
    if algorithm == "ring":  # reduce-scatter skips chunk r, all-gather skips chunk r+1
        return (n - sizes[rank]) + (n - sizes[(rank + 1) % p])
    if algorithm == "reduce_scatter":
        return n - sizes[rank]
    if algorithm == "all_gather":
        return (p - 1) * n
    if algorithm == "recursive_doubling":
        q = 1 << (p.bit_length() - 1)
        if rank >= q:
            return n
        return n * int(math.log2(q)) + (n if rank < p - q else 0)
    v = (rank - root) % p
    bcast = _tree_children(v, p) * n
    if algorithm == "broadcast":
        return bcast
    return (n if v != 0 else 0) + bcast  # reduce_broadcast: reduce (non-roots send once) + bcast


def fit_alpha_beta(sizes_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit t = α + n·β to point-to-point timings; returns (α, β).

    Weighted least squares on *relative* error (weights 1/t²): timings span 1 KB to 64 MB, and a
    plain fit lets the largest messages dictate everything (a negative α is typical).
    """
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError(
            f"need >= 2 (size, time) pairs of equal length, got {len(sizes_bytes)} sizes and "
            f"{len(seconds)} times"
        )
    if len(set(sizes_bytes)) < 2:
        raise ValueError("all message sizes are equal: β cannot be fitted")
    if min(seconds) <= 0:
        raise ValueError(f"timings must be positive, got {min(seconds)}")
    w = [1.0 / t**2 for t in seconds]
    sw = sum(w)
    swn = sum(wi * n for wi, n in zip(w, sizes_bytes))
    swt = sum(wi * t for wi, t in zip(w, seconds))
    swnn = sum(wi * n * n for wi, n in zip(w, sizes_bytes))
    swnt = sum(wi * n * t for wi, n, t in zip(w, sizes_bytes, seconds))
    det = sw * swnn - swn * swn
    alpha = (swt * swnn - swn * swnt) / det
    beta = (sw * swnt - swn * swt) / det
    return alpha, beta


def bus_bandwidth(algorithm: str, nbytes: float, p: int, seconds: float) -> float:
    """NCCL-tests' bus bandwidth (bytes/s): algorithm bandwidth n/t scaled by the fraction of the
    data each rank must move at least, 2(p-1)/p for all-reduce, (p-1)/p for gather/scatter, so
    figures are comparable across p and with the link's raw speed."""
    if seconds <= 0:
        return float("nan")
    factor = {"all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p, "broadcast": 1.0}.get(
        algorithm, 2 * (p - 1) / p
    )
    return nbytes / seconds * factor
