"""Pipeline schedules as data: one list of instructions per stage.

A schedule says, for one stage (rank) of a ``p``-stage pipeline fed ``m`` micro-batches, in which
order it runs forwards and backwards and where the point-to-point transfers sit. Keeping it as
plain data (as DeepSpeed's ``runtime/pipe/schedule.py`` does) means the properties that matter --
one forward and one backward per micro-batch, matched sends and receives, no deadlock, the bubble
and the activation memory -- are checked here without processes, and one small engine executes
every schedule.

Virtual stages (interleaved schedule): the model is cut into ``p·v`` chunks; chunk ``k`` lives on
rank ``k mod p`` as local chunk ``k // p`` (Megatron-LM's layout), so a micro-batch visits every
rank ``v`` times. For the other schedules ``v = 1`` and the virtual stage is the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")


class Op(str, Enum):
    LOAD_MICROBATCH = "load"  # first virtual stage: inputs; last: targets
    RECV_ACTIVATION = "recv_act"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"  # data-parallel and tied-weight gradient reduction
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program.

    ``chunk`` is the local model chunk (0 unless interleaved), ``virtual_stage`` its position in
    the whole pipeline, ``peer`` the pipeline rank on the other end of a send or receive.
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


def validate_schedule_args(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """Fail early, naming the bad value and what would be valid."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {list(SCHEDULES)}")
    for label, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} only applies to the 'interleaved' schedule, "
            f"not {name!r}; use virtual_stages=1"
        )
    if name == "interleaved" and num_microbatches % num_stages != 0:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of num_stages ({num_stages}); e.g. "
            f"{num_stages * max(1, num_microbatches // num_stages)}"
        )


def _compute_order(name: str, p: int, m: int, stage: int, v: int) -> list[tuple[str, int, int]]:
    """The order of ("F" | "B", micro-batch, local chunk) on ``stage``."""
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
    validate_schedule_args(name, num_stages, num_microbatches, virtual_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage!r}")
    p, v = num_stages, virtual_stages
    last = p * v - 1
    order = _compute_order(name, p, num_microbatches, stage, v)
    if forward_only:
        order = sorted((x for x in order if x[0] == "F"), key=lambda x: (x[2], x[1]))
    program: list[Instruction] = []
    for kind, mb, chunk in order:
        vs = chunk * p + stage
        prev_rank, next_rank = (vs - 1) % p, (vs + 1) % p
        if kind == "F":
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
            program.append(Instruction(Op.BACKWARD, mb, chunk, vs))
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
    """Idle fraction with equal forward/backward costs and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v·m+p-1) (each rank's warm-up and
    cool-down shrink to 1/v of a stage); naive: (p-1)/p (only one stage ever works).
    """
    p, m = num_stages, num_microbatches
    if name == "naive":
        return (p - 1) / p
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
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
