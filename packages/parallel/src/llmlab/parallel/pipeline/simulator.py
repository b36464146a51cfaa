"""Run every stage's instruction list together, on paper, with given compute costs.

The model of execution is the engine's: sends are non-blocking (``isend``), a receive blocks until
its partner send has been issued, forwards and backwards take their cost (a split backward: B
``backward_cost``, W ``weight_cost``; a whole backward both), everything else is free (or
``comm_cost`` for a receive). Each instruction starts when its stage is free and, for a
receive, when the data was sent; so the simulated timeline is the engine's timeline with perfect
compute times. No stage able to move while some still have work means the schedule deadlocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmlab.parallel.pipeline.schedules import (
    COMPUTE_OPS,
    Instruction,
    Op,
    ScheduleError,
    message_key,
)


class DeadlockError(ScheduleError):
    """The stages wait on each other: every unfinished stage is blocked on a receive."""


@dataclass(frozen=True)
class TimelineEvent:
    """One executed instruction on one stage, in the simulator's or the engine's clock."""

    stage: int
    op: str
    microbatch: int | None
    chunk: int
    start: float
    end: float


@dataclass
class SimulationResult:
    events: list[TimelineEvent]
    makespan: float
    busy: list[float]  # compute time per stage
    peak_activations: list[int]  # forwards whose (weight) backward has not run yet, max per stage
    bubble_per_stage: list[float] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ``stages × makespan`` rectangle: 1 - Σ busy / (p · makespan)."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan) if self.makespan > 0 else 0.0


def _cost(costs: float | Sequence[float], stage: int) -> float:
    return float(costs if isinstance(costs, (int, float)) else costs[stage])


def simulate(
    programs: Sequence[Sequence[Instruction]],
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 1.0,
    comm_cost: float = 0.0,
    weight_cost: float | Sequence[float] = 0.0,
) -> SimulationResult:
    """Execute ``programs`` (one per stage) together; costs may be per stage (sequences).

    ``backward_cost`` is B's (the input gradient), ``weight_cost`` W's; a whole ``BACKWARD``
    costs their sum, so the defaults (``weight_cost=0``) keep the classic schedules' meaning of
    ``backward_cost`` as the cost of the backward.

    Raises ``DeadlockError`` naming each blocked stage's instruction when no stage can move, and
    ``ScheduleError`` for a message received or sent twice or a send nobody receives.
    """
    p = len(programs)
    pc = [0] * p  # next instruction per stage
    clock = [0.0] * p
    sent: dict[tuple, float] = {}  # message key -> time it was sent
    received: set[tuple] = set()
    in_flight = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    events: list[TimelineEvent] = []
    while any(pc[s] < len(programs[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                key = message_key(ins)
                start = clock[s]
                if ins.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                    if key in received:
                        raise ScheduleError(f"stage {s} receives {key} twice: {ins}")
                    if key not in sent:
                        break  # blocked until the partner send is issued
                    received.add(key)
                    start = max(start, sent[key])
                    end = start + comm_cost
                elif ins.op is Op.FORWARD:
                    end = start + _cost(forward_cost, s)
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                elif ins.op is Op.BACKWARD:
                    end = start + _cost(backward_cost, s) + _cost(weight_cost, s)
                    in_flight[s] -= 1
                elif ins.op is Op.BACKWARD_INPUT:
                    end = start + _cost(backward_cost, s)
                elif ins.op is Op.BACKWARD_WEIGHT:
                    end = start + _cost(weight_cost, s)
                    in_flight[s] -= 1  # what W needed was kept until now
                else:
                    end = start
                if ins.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
                    if key in sent:
                        raise ScheduleError(f"stage {s} sends {key} twice: {ins}")
                    sent[key] = start
                if ins.op in COMPUTE_OPS:
                    busy[s] += end - start
                    events.append(
                        TimelineEvent(s, ins.op.value, ins.microbatch, ins.chunk, start, end)
                    )
                clock[s] = end
                pc[s] += 1
                progressed = True
        if not progressed:
            blocked = {s: str(programs[s][pc[s]]) for s in range(p) if pc[s] < len(programs[s])}
            raise DeadlockError(
                f"pipeline deadlock; blocked stages and their instruction: {blocked}"
            )
    unmatched = set(sent) - received
    if unmatched:
        raise ScheduleError(f"sends without a matching receive: {sorted(unmatched)[:5]}")
    makespan = max(clock) if clock else 0.0
    has_backward = any(
        ins.op in COMPUTE_OPS and ins.op is not Op.FORWARD for prog in programs for ins in prog
    )
    if not has_backward:  # forward-only: activations are dropped as soon as they are sent
        peak = [min(1, x) for x in peak]
    bubbles = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    return SimulationResult(events, makespan, busy, peak, bubbles)
