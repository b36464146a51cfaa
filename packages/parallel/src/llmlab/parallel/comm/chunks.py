"""How a vector of ``n`` elements is cut into ``p`` chunks when ``p`` does not divide ``n``.

The first ``n % p`` chunks get one extra element, like ``torch.tensor_split``; chunks may be
empty (``n < p``). Every rank computes the same bounds, so no sizes need to be exchanged.
"""

from __future__ import annotations


def chunk_sizes(n: int, p: int) -> list[int]:
    if n < 0 or p < 1:
        raise ValueError(f"need n >= 0 and p >= 1, got n={n}, p={p}")
    base, extra = divmod(n, p)
    return [base + (1 if i < extra else 0) for i in range(p)]


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` for each of the ``p`` chunks of ``range(n)``."""
    bounds, start = [], 0
    for size in chunk_sizes(n, p):
        bounds.append((start, start + size))
        start += size
    return bounds
