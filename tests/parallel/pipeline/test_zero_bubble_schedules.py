"""ZB-H1, ZB-V and DualPipeV as data: validated, simulated and compared with torch's orders.

Without any process: every stage's program passes the validator (one F, one B and one W -- or
one whole backward -- per micro-batch and virtual stage, W after its B and before the gradient
reduction, transfers matched and sent to the owner of the neighbouring stage, no deadlock); the
simulated bubble at T_F = T_B = T_W equals the closed form exactly (1e-12); the activation
memory matches the papers' claims. Oracle for the orders themselves: ``torch.distributed.
pipelining`` computes each rank's action list in plain Python (``_calculate_single_rank_
operations``, a private method of the pinned torch 2.13), which our lists must equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmlab.parallel.pipeline.partition import chunk_owner
from llmlab.parallel.pipeline.schedules import (
    Instruction,
    Op,
    ScheduleError,
    all_schedules,
    schedule,
    theoretical_bubble,
)
from llmlab.parallel.pipeline.simulator import DeadlockError, simulate
from llmlab.parallel.pipeline.validate import check_programs, validate_programs

ZB = [("zb1", 1), ("zbv", 2), ("dualpipev", 2)]


def _cases(name: str, p: int) -> range:
    return range(2 * p if name == "dualpipev" else 1, 19)


@pytest.mark.parametrize("name,v", ZB)
def test_split_schedules_validate_and_meet_their_bubble(name, v):
    for p in range(1, 9):
        for m in _cases(name, p):
            programs = all_schedules(name, p, m, v)
            validate_programs(programs, m)
            result = simulate(programs, 1.0, 1.0, weight_cost=1.0)
            least = {"zb1": p, "zbv": (3 * p) // 2, "dualpipev": 2 * p}[name]
            if m >= least:
                bubble = theoretical_bubble(name, p, m, v)
                assert result.bubble_fraction == pytest.approx(bubble, abs=1e-12), (p, m)
            else:
                with pytest.raises(ValueError, match=f">= {least}"):
                    theoretical_bubble(name, p, m, v)
            # every rank runs v chunks, each micro-batch once per chunk
            for prog in programs:
                assert sum(i.op is Op.FORWARD for i in prog) == v * m


@pytest.mark.parametrize("name,v", ZB)
def test_split_schedules_forward_only_run(name, v):
    for p in (1, 2, 4):
        m = 2 * p
        validate_programs(all_schedules(name, p, m, v, forward_only=True), m)


def test_zb1_idles_a_third_of_1f1b_at_equal_costs():
    for p in range(2, 9):
        for m in range(p, 17):
            one = simulate(all_schedules("1f1b", p, m), 1.0, 1.0, weight_cost=1.0)
            zb1 = simulate(all_schedules("zb1", p, m), 1.0, 1.0, weight_cost=1.0)
            idle_1f1b = p * one.makespan - sum(one.busy)
            idle_zb1 = p * zb1.makespan - sum(zb1.busy)
            assert idle_zb1 == pytest.approx(idle_1f1b / 3, abs=1e-9), (p, m)


@pytest.mark.parametrize("f,b,w", [(1, 1, 0.5), (2, 1, 1), (1, 2, 1), (1, 3, 0.25)])
def test_zb1_idle_time_formula_for_unequal_costs(f, b, w):
    """(p-1)(T_F + T_B - T_W) per stage whenever T_W <= T_B (the paper's ZB-H1 figure)."""
    for p in range(2, 7):
        r = simulate(all_schedules("zb1", p, 2 * p), f, b, weight_cost=w)
        idle = p * r.makespan - sum(r.busy)
        assert idle / p == pytest.approx((p - 1) * (f + b - w), abs=1e-9), p


def test_activation_memory_against_1f1b():
    """Micro-batch activations alive at once (from F until W): ZB-H1 keeps p on every stage,
    1F1B's stage-0 peak; ZB-V keeps 2p half-stage chunks (1F1B's p stages); DualPipeV one chunk
    more. ZB-H1 pays for the deferred W's on the later stages, never above 1F1B's worst."""
    for p in range(1, 9):
        m = 2 * p
        one = simulate(all_schedules("1f1b", p, m)).peak_activations
        assert one == [p - s for s in range(p)]
        assert simulate(all_schedules("zb1", p, m)).peak_activations == [p] * p
        assert simulate(all_schedules("zbv", p, m, 2)).peak_activations == [2 * p] * p
        assert simulate(all_schedules("dualpipev", p, m, 2)).peak_activations == [2 * p + 1] * p


def test_v_placement_turns_on_the_last_rank():
    p = 4
    assert [chunk_owner(vs, p, "v") for vs in range(2 * p)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1),
    ]  # fmt: skip
    prog = schedule("zbv", p, 8, p - 1, 2)
    bottom = [i for i in prog if i.op is Op.SEND_ACTIVATION and i.virtual_stage == p - 1]
    assert bottom and all(i.peer == p - 1 for i in bottom)  # stays on the rank
    first = schedule("zbv", p, 8, 0, 2)  # rank 0 holds the first and the last virtual stage
    assert {i.virtual_stage for i in first if i.op is Op.LOAD_MICROBATCH} == {0, 2 * p - 1}


def _torch_orders(name: str, p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """torch's (kind, micro-batch, virtual stage) per rank, its idle slots dropped."""
    from torch.distributed.pipelining import schedules as ts

    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    if name == "zb1":
        cls = ts.ScheduleInterleavedZeroBubble
        rounds = max(1, m // p)
        me.n_local_stages, me.number_of_rounds, me.microbatches_per_round = 1, rounds, m // rounds
    else:
        cls = ts.ScheduleZBVZeroBubble if name == "zbv" else ts.ScheduleDualPipeV
    out = []
    for rank in range(p):
        steps = []
        for action in cls._calculate_single_rank_operations(me, rank):
            if action is None:
                continue
            subs = action.sub_actions or (action,)
            for a in subs:
                steps.append((a.computation_type.value, a.microbatch_index, a.stage_index))
        out.append(steps)
    return out


_OPS = {Op.FORWARD: "F", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W", Op.BACKWARD: "B"}


@pytest.mark.parametrize("name,v", ZB)
def test_orders_equal_torch_pipelining(name, v):
    for p in (1, 2, 3, 4, 8):
        for m in _cases(name, p):
            if name == "zb1" and m % max(1, m // p):
                continue  # torch refuses these micro-batch counts
            ours = [
                [(_OPS[i.op], i.microbatch, i.virtual_stage) for i in prog if i.op in _OPS]
                for prog in all_schedules(name, p, m, v)
            ]
            assert ours == _torch_orders(name, p, m), (name, p, m)


# ------------------------------------------------------------- hand-broken schedules


def _move(prog: list[Instruction], op: Op, mb: int, before: Op) -> list[Instruction]:
    """``prog`` with the first ``op`` of ``mb`` moved just before the first ``before`` of it."""
    ins = next(i for i in prog if i.op is op and i.microbatch == mb)
    rest = [i for i in prog if i is not ins]
    at = next(k for k, i in enumerate(rest) if i.op is before and i.microbatch == mb)
    return [*rest[:at], ins, *rest[at:]]


def test_validator_rejects_a_w_before_its_b():
    programs = all_schedules("zb1", 2, 4)
    programs[1] = _move(programs[1], Op.BACKWARD_WEIGHT, 0, Op.BACKWARD_INPUT)
    with pytest.raises(
        ScheduleError, match=r"stage 1, instruction \d+ \(backward_weight mb=0 vs=1\): W before"
    ):
        validate_programs(programs, 4)


def test_validator_rejects_a_missing_receive():
    programs = all_schedules("zbv", 2, 4, 2)
    recv = next(i for i in programs[1] if i.op is Op.RECV_ACTIVATION and i.microbatch == 2)
    programs[1] = [i for i in programs[1] if i is not recv]
    with pytest.raises(
        ScheduleError,
        match=r"stage 1, instruction \d+ \(forward mb=2 vs=1\): forward before its activation",
    ):
        validate_programs(programs, 4)


def test_validator_rejects_a_missing_gradient_receive_and_a_late_w():
    programs = all_schedules("zb1", 2, 4)
    recv = next(i for i in programs[0] if i.op is Op.RECV_GRAD and i.microbatch == 3)
    broken = [list(programs[0]), programs[1]]
    broken[0].remove(recv)
    with pytest.raises(ScheduleError, match=r"\(backward_input mb=3 vs=0\): backward before"):
        validate_programs(broken, 4)
    reduce = next(i for i in programs[1] if i.op is Op.REDUCE_GRADS)
    rest = [i for i in programs[1] if i is not reduce]
    last_w = max(k for k, i in enumerate(rest) if i.op is Op.BACKWARD_WEIGHT)
    late = [*rest[:last_w], reduce, *rest[last_w:]]  # the gradients reduced before the last W
    with pytest.raises(ScheduleError, match=r"\(reduce_grads\): reduces gradients before the W"):
        validate_programs([programs[0], late], 4)


def test_validator_rejects_a_wrong_peer_and_a_deadlock():
    programs = all_schedules("zbv", 2, 4, 2)
    send = next(i for i in programs[0] if i.op is Op.SEND_ACTIVATION)
    wrong = Instruction(send.op, send.microbatch, send.chunk, send.virtual_stage, peer=0)
    programs[0] = [wrong if i is send else i for i in programs[0]]
    with pytest.raises(ScheduleError, match=r"\(send_act mb=0 vs=0 peer=0\): its partner runs"):
        check_programs(programs, 4)
    # both stages first wait for the other's gradient: structurally fine, deadlocks
    a = all_schedules("gpipe", 2, 1)
    stage0 = _move(a[0], Op.RECV_GRAD, 0, Op.SEND_ACTIVATION)
    with pytest.raises(DeadlockError, match="blocked stages"):
        validate_programs([stage0, a[1]], 1)


@pytest.mark.parametrize(
    "args,match",
    [
        (("zbv", 2, 4, 0, 1), "exactly 2 chunks per rank in a V"),
        (("dualpipev", 2, 4, 0, 3), "use virtual_stages=2"),
        (("zb1", 2, 4, 0, 2), "only applies to the 'interleaved'"),
        (("dualpipev", 4, 6, 0, 2), r"num_microbatches \(6\) >= 2 × num_stages \(8"),
    ],
)
def test_bad_split_schedule_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        schedule(*args)
