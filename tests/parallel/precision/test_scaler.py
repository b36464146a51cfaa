"""DynamicLossScaler policy after DeepSpeed's loss-scaler tests; torch's GradScaler as oracle."""

from __future__ import annotations

import random

import pytest
import torch

from llmlab.parallel.precision import (
    DynamicLossScaler,
    FP16MasterPrecision,
    LossScaleAtMinimumError,
)
from tests.helpers.distributed import run_distributed


def run(scaler: DynamicLossScaler, pattern: str) -> list[tuple[float, int, int]]:
    """Feed a pattern of ``o`` (overflow) / ``.`` (clean) steps; record the state after each."""
    trace = []
    for c in pattern:
        scaler.update(c == "o")
        trace.append((scaler.scale, scaler.growth_tracker, scaler.hysteresis_left))
    return trace


def test_no_overflow_doubles_every_window() -> None:
    s = DynamicLossScaler(init_scale=4.0, growth_interval=3)
    scales = [t[0] for t in run(s, "." * 9)]
    assert scales == [4, 4, 8, 8, 8, 16, 16, 16, 32]


def test_every_step_overflows_halves_down_to_min_then_clamps() -> None:
    s = DynamicLossScaler(
        init_scale=2.0**5, growth_interval=2, hysteresis=1, min_scale=2.0, at_min="clamp"
    )
    scales = [t[0] for t in run(s, "o" * 8)]
    assert scales == [16, 8, 4, 2, 2, 2, 2, 2]
    assert s.overflows == 8


def test_every_step_overflows_raises_at_min_when_configured() -> None:
    s = DynamicLossScaler(
        init_scale=8.0, growth_interval=2, hysteresis=1, min_scale=2.0, at_min="raise"
    )
    assert [t[0] for t in run(s, "oo")] == [4, 2]
    with pytest.raises(LossScaleAtMinimumError, match=r"minimum loss scale 2\.0"):
        s.update(True)


def test_backoff_never_goes_below_min_scale() -> None:
    s = DynamicLossScaler(init_scale=3.0, backoff_factor=0.5, hysteresis=1, min_scale=2.0)
    s.update(True)
    assert s.scale == 2.0


def test_hysteresis_two_documented_sequence() -> None:
    """init 1024, window 2, hysteresis 2 (DeepSpeed's delayed_shift=2), step by step."""
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2, hysteresis=2)
    # (pattern char, expected (scale, growth_tracker, hysteresis_left)) after the step
    expected = [
        ("o", (1024, 0, 1)),  # first overflow spends hysteresis, scale kept
        ("o", (512, 0, 1)),  # second overflow: budget exhausted, back off
        (".", (512, 1, 1)),
        (".", (1024, 0, 2)),  # window of 2 clean steps: grow, refill hysteresis
        ("o", (1024, 0, 1)),  # tolerated
        (".", (1024, 1, 1)),  # non-consecutive hysteresis: one clean step does not refill
        ("o", (512, 0, 1)),  # so this isolated overflow backs off
        ("o", (256, 0, 1)),
        (".", (256, 1, 1)),
        (".", (512, 0, 2)),
    ]
    pattern = "".join(c for c, _ in expected)
    assert run(s, pattern) == [e for _, e in expected]


def test_consecutive_hysteresis_only_backs_off_on_consecutive_overflows() -> None:
    s = DynamicLossScaler(
        init_scale=1024.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True
    )
    expected = [
        ("o", (1024, 0, 1)),
        (".", (1024, 1, 2)),  # any clean step refills the budget
        ("o", (1024, 0, 1)),
        (".", (1024, 1, 2)),
        ("o", (1024, 0, 1)),
        ("o", (512, 0, 1)),  # two in a row: back off
        ("o", (256, 0, 1)),
        (".", (256, 1, 2)),
    ]
    assert run(s, "".join(c for c, _ in expected)) == [e for _, e in expected]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hysteresis_one_matches_torch_gradscaler_update(seed: int) -> None:
    """With hysteresis 1 the policy is GradScaler's: checked against torch._amp_update_scale_."""
    rng = random.Random(seed)
    ours = DynamicLossScaler(
        init_scale=2.0**16, growth_interval=3, hysteresis=1, min_scale=2.0**-60
    )
    scale = torch.full((1,), 2.0**16)
    tracker = torch.zeros(1, dtype=torch.int32)
    for _ in range(200):
        overflow = rng.random() < 0.3
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(overflow)]), 2.0, 0.5, 3)
        ours.update(overflow)
        assert ours.scale == scale.item()
        assert ours.growth_tracker == tracker.item()


@pytest.fixture
def deepspeed_scaler(monkeypatch: pytest.MonkeyPatch):
    """A factory for DeepSpeed's own ``DynamicLossScaler`` with llmlab's argument names."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # update_scale asks deepspeed.comm for the rank only to decide who logs an overflow; there is
    # one process here and no DeepSpeed backend, so rank 0 it is. The policy itself is untouched.
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)

    def make(init_scale: float, growth_interval: int, hysteresis: int, min_scale: float = 1.0,
             consecutive_hysteresis: bool = False):  # fmt: skip
        return loss_scaler.DynamicLossScaler(
            init_scale=init_scale,
            scale_window=growth_interval,
            min_scale=min_scale,
            delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            raise_error_at_min_scale=False,  # = at_min="clamp"
        )

    return make


def run_deepspeed(scaler, pattern: str) -> list[tuple[float, int]]:
    trace = []
    for c in pattern:
        scaler.update_scale(c == "o")
        trace.append((scaler.cur_scale, scaler.cur_hysteresis))
    return trace


def test_defaults_are_deepspeeds_fp16_defaults() -> None:
    constants = pytest.importorskip("deepspeed.runtime.constants")
    s = DynamicLossScaler()
    assert s.scale == 2.0**constants.FP16_INITIAL_SCALE_POWER_DEFAULT
    assert s.growth_interval == constants.FP16_LOSS_SCALE_WINDOW_DEFAULT
    assert s.hysteresis == constants.FP16_HYSTERESIS_DEFAULT
    assert s.consecutive_hysteresis == constants.FP16_CONSECUTIVE_HYSTERESIS_DEFAULT
    assert s.min_scale == constants.FP16_MIN_LOSS_SCALE_DEFAULT
    plugin = FP16MasterPrecision()  # reads the same defaults
    assert plugin.scaler.state_dict() == s.state_dict()


def test_grows_one_clean_step_before_deepspeed_from_the_start_and_after_an_overflow(
    deepspeed_scaler,
) -> None:
    """The docstring's claim, step by step: window w=3, an overflow at step 8 (1-based)."""
    pattern = "......." + "o" + "......."
    ours = [t[0] for t in run(DynamicLossScaler(init_scale=64.0, growth_interval=3), pattern)]
    ds = [t[0] for t in run_deepspeed(deepspeed_scaler(64.0, 3, hysteresis=2), pattern)]
    #       1    2    3    4    5    6    7    8 (o)  9   10   11   12   13   14   15
    assert ours == [64, 64, 128, 128, 128, 256, 256, 256, 256, 256, 512, 512, 512, 1024, 1024]
    assert ds == [64, 64, 64, 128, 128, 128, 256, 256, 256, 256, 256, 512, 512, 512, 1024]
    # growth: here at clean steps 3, 6 and 3, 6 after the overflow; DeepSpeed one step later


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_backoff_hysteresis_and_floor_match_deepspeed(
    deepspeed_scaler, hysteresis: int, consecutive: bool
) -> None:
    """With growth out of reach, every other rule agrees with DeepSpeed's at every step."""
    rng = random.Random(hysteresis * 10 + consecutive)
    pattern = "".join("o" if rng.random() < 0.4 else "." for _ in range(300))
    kwargs = dict(
        init_scale=2.0**16, growth_interval=10**9, hysteresis=hysteresis, min_scale=2.0**6
    )
    ours = DynamicLossScaler(**kwargs, consecutive_hysteresis=consecutive)
    ds = deepspeed_scaler(**kwargs, consecutive_hysteresis=consecutive)
    assert [(t[0], t[2]) for t in run(ours, pattern)] == run_deepspeed(ds, pattern)
    assert ours.scale == 2.0**6  # the floor was reached and held (clamp)


def test_state_dict_round_trip_continues_identically() -> None:
    rng = random.Random(7)
    pattern = "".join("o" if rng.random() < 0.3 else "." for _ in range(60))
    kwargs = dict(init_scale=2.0**10, growth_interval=3, hysteresis=3)
    a = DynamicLossScaler(**kwargs)
    run(a, pattern[:25])
    b = DynamicLossScaler(init_scale=1.0)  # different settings: the state carries them
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert run(a, pattern[25:]) == run(b, pattern[25:])


def test_found_inf_sees_inf_and_nan() -> None:
    good = [torch.ones(3), None, torch.zeros(2, 2)]
    assert not DynamicLossScaler.found_inf(good)
    assert DynamicLossScaler.found_inf([*good, torch.tensor([1.0, float("inf")])])
    assert DynamicLossScaler.found_inf([torch.tensor([float("nan")], dtype=torch.float16)])
    assert not DynamicLossScaler.found_inf([])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(at_min="ignore"), "at_min"),
        (dict(init_scale=1.0, min_scale=4.0), "below min_scale"),
    ],
)
def test_bad_settings_fail_early(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def _overflow_on_one_rank(rank: int, world_size: int) -> tuple[bool, bool]:
    grads = [torch.ones(4)]
    clean = DynamicLossScaler.found_inf(grads)
    if rank == 1:
        grads.append(torch.tensor([float("inf")]))
    return clean, DynamicLossScaler.found_inf(grads)


@pytest.mark.distributed
def test_overflow_on_one_rank_skips_on_every_rank() -> None:
    assert run_distributed(_overflow_on_one_rank, 2) == [(False, True), (False, True)]
