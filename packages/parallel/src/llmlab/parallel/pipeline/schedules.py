"""Pipeline schedules as data: one list of instructions per stage.

A schedule says, for one stage (rank) of a ``p``-stage pipeline fed ``m`` micro-batches, in which
order it runs forwards and backwards and where the point-to-point transfers sit. Keeping it as
plain data (as DeepSpeed's ``runtime/pipe/schedule.py`` does) means the properties that matter --
one forward and one backward per micro-batch, matched sends and receives, no deadlock, the bubble
and the activation memory -- are checked here without processes, and one small engine executes
every schedule.

Virtual stages: the model is cut into ``p·v`` chunks. Interleaved: chunk ``k`` lives on rank
``k mod p`` as local chunk ``k // p`` (Megatron-LM's layout), so a micro-batch visits every rank
``v`` times. ZB-V and DualPipeV (``v = 2``): rank ``r`` holds chunks ``r`` and ``2p−1−r``, a V
(:func:`~llmlab.parallel.pipeline.partition.chunk_owner`). For the other schedules ``v = 1`` and
the virtual stage is the stage.

Split backward (ZB-H1, ZB-V, DualPipeV): ``BACKWARD_INPUT`` computes the gradient of the stage's
input (what the previous stage waits for) and ``BACKWARD_WEIGHT``, later, its weight gradients;
``BACKWARD`` does both at once (:mod:`~llmlab.parallel.pipeline.split_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llmlab.parallel.pipeline.partition import chunk_owner, local_virtual_stages
from llmlab.parallel.pipeline.zero_bubble import dualpipev_order, zb1_order, zbv_order
from llmlab.parallel.schedule_args import (  # noqa: F401  (the schedules' names, re-exported)
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    placement,
    validate_schedule_args,
)


class ScheduleError(ValueError):
    """A schedule that cannot run as written; the message names the offending instruction."""


class Op(str, Enum):
    LOAD_MICROBATCH = "load"  # first virtual stage: inputs; last: targets
    RECV_ACTIVATION = "recv_act"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"  # input and weight gradients together
    BACKWARD_INPUT = "backward_input"  # B: the input gradient only, keeping what W needs
    BACKWARD_WEIGHT = "backward_weight"  # W: the weight gradients B left behind
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"  # data-parallel and tied-weight gradient reduction
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
KIND_OPS = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT}


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program.

    ``chunk`` is the local model chunk (0 unless the rank holds several), ``virtual_stage`` its
    position in the whole pipeline, ``peer`` the pipeline rank at the other end of a transfer.
    """

    op: Op
    microbatch: int | None = None
    chunk: int = 0
    virtual_stage: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        parts = [self.op.value]
        if self.microbatch is not None:
            parts.append(f"mb={self.microbatch}")
            parts.append(f"vs={self.virtual_stage}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        return "(" + " ".join(parts) + ")"


def _compute_order(name: str, p: int, m: int, stage: int, v: int) -> list[tuple[str, int, int]]:
    """The order of (kind, micro-batch, local chunk) on ``stage``; kinds as in ``KIND_OPS``."""
    if name == "zb1":
        return zb1_order(p, m, stage)
    if name == "zbv":
        return zbv_order(p, m, stage)
    if name == "dualpipev":
        return dualpipev_order(p, m, stage)
    if name == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if name in ("naive", "1f1b"):
        # naive: no warm-up at all -- a micro-batch goes all the way forward and back before the
        # next one starts. 1f1b (PipeDream-flush): p-s-1 warm-up forwards, then alternate, so at
        # most p-s activations are ever alive on stage s.
        warmup = 0 if name == "naive" else min(p - stage - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        return order + [("B", i, 0) for i in range(m - warmup, m)]
    # interleaved (Megatron-LM): micro-batches go in groups of p through chunk 0, then chunk 1...
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd_chunk(k: int) -> int:
        return (k // p) % v

    def bwd_chunk(k: int) -> int:
        return v - 1 - (k // p) % v

    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [("F", mb(k), fwd_chunk(k)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        order += [("F", mb(k), fwd_chunk(k)), ("B", mb(i), bwd_chunk(i))]
    return order + [("B", mb(k), bwd_chunk(k)) for k in range(total - warmup, total)]


def schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
    forward_only: bool = False,
) -> list[Instruction]:
    """The instruction list of ``stage`` for schedule ``name``.

    ``forward_only`` (validation): the forwards in schedule order, with their transfers, and no
    backward, gradient reduction or optimizer step.
    """
    validate_schedule_args(
        name, num_stages, num_microbatches, virtual_stages, allow_split_backward=True
    )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage!r}")
    p, v = num_stages, virtual_stages
    last = p * v - 1
    order = _compute_order(name, p, num_microbatches, stage, v)
    if forward_only:
        order = sorted((x for x in order if x[0] == "F"), key=lambda x: (x[2], x[1]))
    where = placement(name)
    chunk_vs = local_virtual_stages(stage, p, v, where)
    program: list[Instruction] = []
    for kind, mb, chunk in order:
        vs = chunk_vs[chunk]
        prev_rank = chunk_owner(vs - 1, p, where)[0] if vs > 0 else None
        next_rank = chunk_owner(vs + 1, p, where)[0] if vs < last else None
        if kind == "W":  # no transfer: the weight gradients stay on this stage
            program.append(Instruction(Op.BACKWARD_WEIGHT, mb, chunk, vs))
        elif kind == "F":
            if vs == 0 or vs == last:
                program.append(Instruction(Op.LOAD_MICROBATCH, mb, chunk, vs))
            if vs > 0:
                program.append(Instruction(Op.RECV_ACTIVATION, mb, chunk, vs, prev_rank))
            program.append(Instruction(Op.FORWARD, mb, chunk, vs))
            if vs < last:
                program.append(Instruction(Op.SEND_ACTIVATION, mb, chunk, vs, next_rank))
        else:
            if vs < last:
                program.append(Instruction(Op.RECV_GRAD, mb, chunk, vs, next_rank))
            program.append(Instruction(KIND_OPS[kind], mb, chunk, vs))
            if vs > 0:
                program.append(Instruction(Op.SEND_GRAD, mb, chunk, vs, prev_rank))
    if not forward_only:
        program += [Instruction(Op.REDUCE_GRADS), Instruction(Op.OPTIMIZER_STEP)]
    return program


def all_schedules(
    name: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    forward_only: bool = False,
) -> list[list[Instruction]]:
    """Every stage's instruction list, indexed by stage."""
    return [
        schedule(name, num_stages, num_microbatches, s, virtual_stages, forward_only)
        for s in range(num_stages)
    ]


def theoretical_bubble(name: str, num_stages: int, num_microbatches: int, v: int = 1) -> float:
    """Idle fraction with equal compute costs and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1), whatever the forward/backward ratio; interleaved:
    (p-1)/(v·m+p-1) (each rank's warm-up and cool-down shrink to 1/v of a stage); naive: (p-1)/p
    (only one stage ever works). Split backward, at T_F = T_B = T_W (per chunk): ZB-H1 idles
    (p-1)·T per stage against 1F1B's 3(p-1)·T, so (p-1)/(3m+p-1) for m >= p; ZB-V and DualPipeV
    idle only while the first forward travels down (p-1 chunk times) among 6m per rank, so
    (p-1)/(6m+p-1), for m >= floor(3p/2) (ZB-V; DualPipeV needs m >= 2p anyway). Below those
    micro-batch counts the warm-up is not filled and the closed form does not hold: ``simulate``
    gives the exact figure.
    """
    p, m = num_stages, num_microbatches
    if name == "naive":
        return (p - 1) / p
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name in ("zb1", "zbv", "dualpipev"):
        least = {"zb1": p, "zbv": (3 * p) // 2, "dualpipev": 2 * p}[name]
        if m < least:
            raise ValueError(
                f"the {name} bubble formula holds for num_microbatches >= {least} at "
                f"{p} stages, got {m}; use simulate() for the exact figure"
            )
        return (p - 1) / ((3 if name == "zb1" else 6) * m + p - 1)
    return (p - 1) / (m + p - 1)


def message_key(ins: Instruction) -> tuple[str, int, int] | None:
    """What a transfer carries: (kind, micro-batch, receiving virtual stage). Sends and receives
    with equal keys are each other's partners."""
    if ins.op is Op.SEND_ACTIVATION:
        return ("act", ins.microbatch, ins.virtual_stage + 1)
    if ins.op is Op.RECV_ACTIVATION:
        return ("act", ins.microbatch, ins.virtual_stage)
    if ins.op is Op.SEND_GRAD:
        return ("grad", ins.microbatch, ins.virtual_stage - 1)
    if ins.op is Op.RECV_GRAD:
        return ("grad", ins.microbatch, ins.virtual_stage)
    return None
