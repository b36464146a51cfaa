"""Checking schedules before they run: the structure, then a dry run for deadlocks.

A hand-written or generated schedule that is wrong fails on a real pipeline as a hang or as a
silently wrong gradient, so every program is checked here first, for all stages together, and a
violation is reported as the instruction that breaks it ("stage 1, instruction 7
(backward_weight mb=0 vs=1): W before its B"). ``check_programs`` checks what needs no timing;
``validate_programs`` adds the simulator's dry run (deadlock-freedom, each message sent and
received exactly once). The engine validates each (schedule, stages, micro-batches) once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from llmlab.parallel.pipeline.schedules import (
    Instruction,
    Op,
    ScheduleError,
    all_schedules,
    message_key,
)
from llmlab.parallel.pipeline.simulator import simulate

_BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)
_RECEIVES = (Op.RECV_ACTIVATION, Op.RECV_GRAD)


def _fail(stage: int, index: int, ins: Instruction, why: str) -> ScheduleError:
    return ScheduleError(f"stage {stage}, instruction {index} {ins}: {why}")


def _owners(programs: Sequence[Sequence[Instruction]]) -> dict[int, tuple[int, int]]:
    """virtual stage -> (stage, chunk) that runs it; one owner each."""
    owner: dict[int, tuple[int, int]] = {}
    for s, prog in enumerate(programs):
        for i, ins in enumerate(prog):
            if ins.microbatch is None:
                continue
            seen = owner.setdefault(ins.virtual_stage, (s, ins.chunk))
            if seen != (s, ins.chunk):
                raise _fail(
                    s, i, ins, f"virtual stage {ins.virtual_stage} already runs on stage "
                    f"{seen[0]} chunk {seen[1]}"
                )  # fmt: skip
    return owner


def _expected_peer(ins: Instruction, owner: dict[int, tuple[int, int]]) -> int | None:
    """The stage on the other end of a transfer, from who owns the neighbouring stage."""
    other = {
        Op.SEND_ACTIVATION: ins.virtual_stage + 1,
        Op.RECV_ACTIVATION: ins.virtual_stage - 1,
        Op.SEND_GRAD: ins.virtual_stage - 1,
        Op.RECV_GRAD: ins.virtual_stage + 1,
    }[ins.op]
    return owner[other][0] if other in owner else None


def check_programs(programs: Sequence[Sequence[Instruction]], num_microbatches: int) -> None:
    """Structural checks that need no timing; raises ``ScheduleError`` naming the instruction.

    Each (micro-batch, virtual stage) runs on one stage and chunk, is forwarded exactly once and
    (with backwards) backwarded exactly once after its forward -- whole, or as B then W; every W
    follows its B and precedes the gradient reduction; data is received before it is used and
    sent after it is produced, to the stage that owns the neighbouring virtual stage; every send
    has exactly one matching receive and vice versa.
    """
    owner = _owners(programs)
    last = max(owner, default=0)
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    for s, prog in enumerate(programs):
        done_f: set[tuple[int, int]] = set()
        done_b: set[tuple[int, int]] = set()
        waiting_w: dict[tuple[int, int], int] = {}  # B done, W not yet: key -> B's index
        done_w: set[tuple[int, int]] = set()
        got: set[tuple] = set()
        for i, ins in enumerate(prog):
            if ins.op is Op.REDUCE_GRADS and waiting_w:
                key = min(waiting_w)
                raise _fail(s, i, ins, f"reduces gradients before the W of (mb, vs) {key}")
            if ins.microbatch is None:
                continue
            key = (ins.microbatch, ins.virtual_stage)
            msg = message_key(ins)
            if msg is not None:
                expected = _expected_peer(ins, owner)
                if expected is not None and ins.peer != expected:
                    raise _fail(s, i, ins, f"its partner runs on stage {expected}")
            if ins.op is Op.FORWARD:
                if key in fwd:
                    raise _fail(s, i, ins, "forward twice")
                if ins.virtual_stage > 0 and ("act", *key) not in got:
                    raise _fail(s, i, ins, "forward before its activation is received")
                fwd[key] = s
                done_f.add(key)
            elif ins.op in _BACKWARDS:
                if key in bwd:
                    raise _fail(s, i, ins, "backward twice")
                if key not in done_f:
                    raise _fail(s, i, ins, "backward before its forward")
                if ins.virtual_stage < last and ("grad", *key) not in got:
                    raise _fail(s, i, ins, "backward before its output gradient is received")
                bwd[key] = s
                done_b.add(key)
                if ins.op is Op.BACKWARD_INPUT:
                    waiting_w[key] = i
            elif ins.op is Op.BACKWARD_WEIGHT:
                if key in done_w:
                    raise _fail(s, i, ins, "W twice")
                if key not in waiting_w:
                    raise _fail(s, i, ins, "W before its B (backward_input)")
                del waiting_w[key]
                done_w.add(key)
            elif ins.op in _RECEIVES:
                if msg in recvs:
                    raise _fail(s, i, ins, "received twice")
                recvs[msg] = s
                got.add(msg)
            elif ins.op is Op.SEND_ACTIVATION:
                if key not in done_f:
                    raise _fail(s, i, ins, "sends an activation before its forward")
                sends[msg] = s
            elif ins.op is Op.SEND_GRAD:
                if key not in done_b:
                    raise _fail(s, i, ins, "sends a gradient before its backward")
                sends[msg] = s
        if waiting_w:
            key, index = min(waiting_w.items())
            raise _fail(s, index, prog[index], "B without its W")
        if done_b and done_f != done_b:
            raise ScheduleError(f"stage {s}: forwards without backward {sorted(done_f - done_b)}")
    expected = {(mb, vs) for mb in range(num_microbatches) for vs in range(last + 1)}
    if set(fwd) != expected:
        raise ScheduleError(f"missing forwards (mb, vs): {sorted(expected - set(fwd))[:5]}")
    if bwd and set(bwd) != expected:
        raise ScheduleError(f"missing backwards (mb, vs): {sorted(expected - set(bwd))[:5]}")
    if set(sends) != set(recvs):
        raise ScheduleError(
            f"unmatched transfers: sent but never received {sorted(set(sends) - set(recvs))[:5]}"
            f", received but never sent {sorted(set(recvs) - set(sends))[:5]}"
        )


def validate_programs(programs: Sequence[Sequence[Instruction]], num_microbatches: int) -> None:
    """``check_programs``, then a dry run: raises ``ScheduleError`` (``DeadlockError`` when the
    stages would wait on each other forever)."""
    check_programs(programs, num_microbatches)
    simulate(programs)


@functools.lru_cache(maxsize=128)
def validated_schedules(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
    forward_only: bool = False,
) -> tuple[tuple[Instruction, ...], ...]:  # fmt: skip
    """``all_schedules(...)`` after ``validate_programs`` passed, cached per arguments (the
    engine asks once per step; the check runs once)."""
    programs = all_schedules(name, num_stages, num_microbatches, virtual_stages, forward_only)
    validate_programs(programs, num_microbatches)
    return tuple(tuple(prog) for prog in programs)
