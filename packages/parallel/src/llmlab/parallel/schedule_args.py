"""The pipeline schedules' names and the arguments each accepts: plain data and checks.

A leaf module (no torch, no process groups), so that the layout (:mod:`llmlab.parallel.mesh`)
validates a schedule without importing the pipeline machinery that runs it; the schedules
themselves are :mod:`llmlab.parallel.pipeline.schedules`.
"""

from __future__ import annotations

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed in a V
SPLIT_BACKWARD = ("zb1", "zbv", "dualpipev")


def validate_schedule_args(
    name: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    allow_split_backward: bool = False,
) -> None:
    """Fail early, naming the bad value and what would be valid.

    ``allow_split_backward``: whether the caller runs the split-backward schedules (B and W as
    separate instructions, V-placed chunks, shared recompute); the engine and the N-D strategy
    do. A caller that runs only whole backwards leaves it False and refuses them by name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {list(SCHEDULES)}")
    if name in SPLIT_BACKWARD and not allow_split_backward:
        raise ValueError(
            f"the {name!r} schedule (split backward) needs a runner of B and W instructions "
            "on V-placed chunks (PipelineEngine, NDParallelStrategy); this caller runs whole "
            "backwards only: use 'naive', 'gpipe', '1f1b' or 'interleaved' here"
        )
    for label, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name in V_SHAPED and virtual_stages != 2:
        raise ValueError(
            f"the {name!r} schedule places exactly 2 chunks per rank in a V (rank r holds "
            f"stages r and 2p-1-r), got virtual_stages={virtual_stages}; use virtual_stages=2"
        )
    if name not in V_SHAPED and name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} only applies to the 'interleaved' schedule "
            f"(and 2 to {' and '.join(repr(n) for n in V_SHAPED)}), not {name!r}; use "
            "virtual_stages=1"
        )
    if name == "dualpipev" and num_microbatches < 2 * num_stages:
        raise ValueError(
            f"the dualpipev schedule needs num_microbatches ({num_microbatches}) >= 2 × "
            f"num_stages ({2 * num_stages}: one per virtual stage of the V)"
        )
    if name == "interleaved" and num_microbatches % num_stages != 0:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of num_stages ({num_stages}); e.g. "
            f"{num_stages * max(1, num_microbatches // num_stages)}"
        )


def placement(name: str) -> str:
    """Where a schedule puts its chunks: "v" for the V-shaped ones, "loop" otherwise."""
    return "v" if name in V_SHAPED else "loop"
