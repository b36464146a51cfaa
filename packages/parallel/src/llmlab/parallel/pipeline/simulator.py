"""Run every stage's instruction list together, on paper, with given compute costs.

The model of execution is the engine's: sends are non-blocking (``isend``), a receive blocks until
its partner send has been issued, forwards and backwards take their cost, everything else is free
(or ``comm_cost`` for a receive). Each instruction starts when its stage is free and, for a
receive, when the data was sent; so the simulated timeline is the engine's timeline with perfect
compute times. No stage able to move while some still have work means the schedule deadlocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmlab.parallel.pipeline.schedules import Instruction, Op, message_key


class DeadlockError(RuntimeError):
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
    peak_activations: list[int]  # forwards whose backward has not run yet, maximum, per stage
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
) -> SimulationResult:
    """Execute ``programs`` (one per stage) together; costs may be per stage (sequences).

    Raises ``DeadlockError`` naming each blocked stage's instruction when no stage can move, and
    ``ValueError`` for a receive whose partner was already consumed or a send nobody receives.
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
                        raise ValueError(f"stage {s} receives {key} twice")
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
                    end = start + _cost(backward_cost, s)
                    in_flight[s] -= 1
                else:
                    end = start
                if ins.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
                    if key in sent:
                        raise ValueError(f"stage {s} sends {key} twice")
                    sent[key] = start
                if ins.op in (Op.FORWARD, Op.BACKWARD):
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
        raise ValueError(f"sends without a matching receive: {sorted(unmatched)[:5]}")
    makespan = max(clock) if clock else 0.0
    has_backward = any(ins.op is Op.BACKWARD for prog in programs for ins in prog)
    if not has_backward:  # forward-only: activations are dropped as soon as they are sent
        peak = [min(1, x) for x in peak]
    bubbles = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    return SimulationResult(events, makespan, busy, peak, bubbles)


def check_programs(programs: Sequence[Sequence[Instruction]], num_microbatches: int) -> None:
    """Structural checks that need no timing; raises ``AssertionError`` naming the violation.

    Each (micro-batch, virtual stage) is forwarded exactly once and (if there are backwards)
    backwarded exactly once, after its forward; received data is received before it is used and
    sent after it is produced; every send has exactly one matching receive and vice versa.
    """
    p = len(programs)
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    chunks_per_stage: set[int] = set()
    for s, prog in enumerate(programs):
        done_f: set[tuple[int, int]] = set()
        done_b: set[tuple[int, int]] = set()
        got: set[tuple] = set()
        for ins in prog:
            if ins.microbatch is None:
                continue
            key = (ins.microbatch, ins.virtual_stage)
            assert ins.virtual_stage % p == s, f"{ins} runs on stage {s}, not its own"
            chunks_per_stage.add(ins.chunk)
            msg = message_key(ins)
            if ins.op is Op.FORWARD:
                assert key not in fwd, f"forward {key} twice"
                if ins.virtual_stage > 0:
                    assert ("act", *key) in got, f"stage {s}: forward {key} before its receive"
                fwd[key] = s
                done_f.add(key)
            elif ins.op is Op.BACKWARD:
                assert key not in bwd, f"backward {key} twice"
                assert key in done_f, f"stage {s}: backward {key} before its forward"
                bwd[key] = s
                done_b.add(key)
            elif ins.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                assert msg not in recvs, f"receive {msg} twice"
                recvs[msg] = s
                got.add(msg)
            elif ins.op is Op.SEND_ACTIVATION:
                assert key in done_f, f"stage {s}: sends activation {key} before its forward"
                sends[msg] = s
            elif ins.op is Op.SEND_GRAD:
                assert key in done_b, f"stage {s}: sends gradient {key} before its backward"
                sends[msg] = s
        if any(i.op is Op.BACKWARD for i in prog):
            assert done_f == done_b, f"stage {s}: forwards without backward {done_f - done_b}"
    v = len(chunks_per_stage)
    expected = {(mb, vs) for mb in range(num_microbatches) for vs in range(p * v)}
    assert set(fwd) == expected, f"missing forwards: {sorted(expected - set(fwd))[:5]}"
    if bwd:
        assert set(bwd) == expected, f"missing backwards: {sorted(expected - set(bwd))[:5]}"
    assert set(sends) == set(recvs), (
        f"unmatched transfers: sends only {sorted(set(sends) - set(recvs))[:5]}, "
        f"receives only {sorted(set(recvs) - set(sends))[:5]}"
    )
