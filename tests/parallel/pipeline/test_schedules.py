"""Schedules are data: their properties are checked exhaustively without any process."""

from __future__ import annotations

import pytest

from llmlab.parallel.pipeline.schedules import (
    Instruction,
    Op,
    ScheduleError,
    all_schedules,
    schedule,
    theoretical_bubble,
)
from llmlab.parallel.pipeline.simulator import DeadlockError, simulate
from llmlab.parallel.pipeline.validate import check_programs

FLAT_CASES = [(p, m) for p in range(1, 9) for m in range(1, 17)]
INTERLEAVED_CASES = [(p, v, m) for p in range(1, 9) for v in range(2, 5) for m in range(p, 17, p)]


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_flat_schedules_exhaustively(name):
    for p, m in FLAT_CASES:
        programs = all_schedules(name, p, m)
        check_programs(programs, m)  # one F and one B per (mb, stage), in order; sends matched
        result = simulate(programs)  # raises on deadlock
        bubble = theoretical_bubble(name, p, m)
        assert result.bubble_fraction == pytest.approx(bubble, abs=1e-12), (name, p, m)
        if name == "gpipe":
            assert result.peak_activations == [m] * p, (p, m)
        if name == "1f1b":
            assert all(result.peak_activations[s] <= p - s for s in range(p)), (p, m)
            assert all(result.peak_activations[s] == min(p - s, m) for s in range(p)), (p, m)
        if name == "naive":
            assert result.peak_activations == [1] * p


def test_flat_bubble_formula_values():
    # the formula written out, so a wrong theoretical_bubble cannot hide a wrong simulator
    assert simulate(all_schedules("gpipe", 4, 8)).bubble_fraction == pytest.approx(3 / 11)
    assert simulate(all_schedules("1f1b", 2, 4)).bubble_fraction == pytest.approx(1 / 5)
    assert simulate(all_schedules("interleaved", 4, 8, 2)).bubble_fraction == pytest.approx(3 / 19)
    assert simulate(all_schedules("naive", 4, 3)).bubble_fraction == pytest.approx(3 / 4)


def test_interleaved_schedule_exhaustively():
    for p, v, m in INTERLEAVED_CASES:
        programs = all_schedules("interleaved", p, m, v)
        check_programs(programs, m)
        result = simulate(programs)
        expected = (p - 1) / (v * m + p - 1)
        assert result.bubble_fraction == pytest.approx(expected, abs=1e-12), (p, v, m)
        # each rank holds v chunks: every micro-batch is forwarded and backwarded v times there
        for prog in programs:
            assert sum(i.op is Op.FORWARD for i in prog) == v * m
            assert {i.chunk for i in prog if i.microbatch is not None} == set(range(v))


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("naive", 1), ("interleaved", 2)])
def test_forward_only_schedules_have_no_backward_and_run(name, v):
    for p in (1, 2, 4):
        for m in (p, 2 * p):
            programs = all_schedules(name, p, m, v, forward_only=True)
            assert not any(i.op in (Op.BACKWARD, Op.OPTIMIZER_STEP) for pr in programs for i in pr)
            check_programs(programs, m)
            simulate(programs)


def test_schedules_end_with_reduce_and_step():
    prog = schedule("1f1b", 4, 8, 2)
    assert [i.op for i in prog[-2:]] == [Op.REDUCE_GRADS, Op.OPTIMIZER_STEP]
    # first stage loads inputs, last stage loads targets, middle stages load nothing
    assert not any(i.op is Op.LOAD_MICROBATCH for i in prog)
    assert sum(i.op is Op.LOAD_MICROBATCH for i in schedule("1f1b", 4, 8, 0)) == 8


def test_simulator_detects_deadlock():
    # both stages wait for the other's activation first: a classic cyclic wait
    a = [Instruction(Op.RECV_GRAD, 0, 0, 0, 1), Instruction(Op.FORWARD, 0, 0, 0)]
    b = [Instruction(Op.RECV_ACTIVATION, 0, 0, 1, 0), Instruction(Op.FORWARD, 0, 0, 1)]
    with pytest.raises(DeadlockError, match="blocked stages"):
        simulate([a, b])


def test_check_programs_catches_a_dropped_backward():
    programs = all_schedules("gpipe", 2, 2)
    programs[1] = [
        i for i in programs[1] if not (i.op in (Op.BACKWARD, Op.SEND_GRAD) and i.microbatch == 1)
    ]
    with pytest.raises(ScheduleError, match="forwards without backward"):
        check_programs(programs, 2)


def test_simulator_uses_unequal_costs():
    # gpipe, p=2, m=2, backward twice the forward: 2F + (F) + 2B + (B) on the critical path
    r = simulate(all_schedules("gpipe", 2, 2), forward_cost=1.0, backward_cost=2.0)
    assert r.makespan == pytest.approx(3 * 1.0 + 3 * 2.0)


@pytest.mark.parametrize(
    "args,match",
    [
        (("zigzag", 2, 4, 0), "unknown pipeline schedule 'zigzag'"),
        (("gpipe", 0, 4, 0), "num_stages must be a positive integer"),
        (("gpipe", 2, 4, 2), r"stage must be in \[0, 2\)"),
        (("interleaved", 4, 6, 0, 2), r"num_microbatches \(6\) to be a multiple of num_stages"),
        (("1f1b", 2, 4, 0, 2), "only applies to the .interleaved."),
    ],
)
def test_bad_schedule_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        schedule(*args)
