"""Cutting ``pipeline_layers()`` into contiguous stages.

A pipeline is only as fast as its slowest stage, so the default cut balances parameter count (a
proxy for compute in a stack of equal blocks): the contiguous split of the layer list into ``k``
parts that minimises the largest part, found exactly by dynamic programming (the lists are short).
Explicit ``boundaries`` override it: the index of the first layer of every stage but the first.

With ``v`` virtual stages per rank there are ``p·v`` parts; part ``k`` lives on rank ``k mod p`` as
its local chunk ``k // p`` (Megatron-LM's interleaved layout), or, for the V-shaped schedules,
rank ``r`` holds parts ``r`` and ``2p−1−r`` (:func:`chunk_owner`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def layer_param_counts(layers: Sequence[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def balanced_boundaries(sizes: Sequence[int], parts: int) -> list[int]:
    """Start indices of parts 1..k-1 of the contiguous split minimising the largest part's sum.

    Ties are broken towards earlier cuts so the result is deterministic on every rank.
    """
    n = len(sizes)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest possible max-part for the first i layers in k parts; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(parts, 1, -1):
        i = cut[k][i]
        bounds.append(i)
    return sorted(bounds)


def validate_boundaries(boundaries: Sequence[int], num_layers: int, parts: int) -> list[int]:
    bounds = list(boundaries)
    if len(bounds) != parts - 1:
        raise ValueError(
            f"boundaries {bounds} give {len(bounds) + 1} stages, but {parts} are needed "
            f"(stages × virtual stages); pass {parts - 1} increasing layer indices"
        )
    if any(not isinstance(b, int) for b in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(f"boundaries must be strictly increasing integers, got {bounds}")
    if bounds and (bounds[0] < 1 or bounds[-1] > num_layers - 1):
        raise ValueError(
            f"boundaries {bounds} must lie in [1, {num_layers - 1}] for a model with "
            f"{num_layers} pipeline layers (each stage needs at least one layer)"
        )
    return bounds


def split_ranges(
    layers: Sequence[nn.Module], parts: int, boundaries: Sequence[int] | None = None
) -> list[range]:
    """The layer index range of each of ``parts`` contiguous parts."""
    n = len(layers)
    if parts > n:
        raise ValueError(
            f"the model has {n} pipeline layers, fewer than the {parts} stages asked for "
            f"(stages × virtual stages); use at most {n} stages"
        )
    if boundaries is None:
        bounds = balanced_boundaries(layer_param_counts(layers), parts)
    else:
        bounds = validate_boundaries(boundaries, n, parts)
    edges = [0, *bounds, n]
    return [range(edges[k], edges[k + 1]) for k in range(parts)]


PLACEMENTS = ("loop", "v")


def chunk_owner(virtual_stage: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """(rank within the pipeline, local chunk index) of ``virtual_stage``.

    ``loop`` (Megatron-LM's interleaving): chunk ``k`` of rank ``r`` is virtual stage
    ``k·p + r``, so a micro-batch loops over the ranks ``v`` times. ``v`` (ZB-V, DualPipeV; two
    chunks): rank ``r`` holds virtual stages ``r`` and ``2p−1−r``, so a micro-batch goes down the
    ranks and back up, and the turn at the bottom (``p−1 → p``) stays on rank ``p−1``.
    """
    if placement == "loop":
        return virtual_stage % num_stages, virtual_stage // num_stages
    if placement == "v":
        if virtual_stage < num_stages:
            return virtual_stage, 0
        return 2 * num_stages - 1 - virtual_stage, 1
    raise ValueError(f"unknown chunk placement {placement!r}; valid: {list(PLACEMENTS)}")


def local_virtual_stages(
    stage: int, num_stages: int, virtual_stages: int, placement: str = "loop"
) -> list[int]:
    """The virtual stages held by ``stage``, in local chunk order."""
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(
                f"the V placement holds exactly 2 chunks per rank, got virtual_stages="
                f"{virtual_stages}"
            )
        return [stage, 2 * num_stages - 1 - stage]
    chunk_owner(0, num_stages, placement)  # names a bad placement
    return [chunk * num_stages + stage for chunk in range(virtual_stages)]
