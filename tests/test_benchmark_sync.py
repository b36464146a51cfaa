"""``benchmarks/sync.py``'s three fp16 steps: how many host reads each makes per step, and that
they train identically (the comparison of their times means something only if they do).

Run at toy sizes on the CPU, where reads are counted at the Python level (``Tensor.item``,
``__bool__``, ...); the smoke run of the whole benchmark is in test_benchmarks_smoke.py.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import sync


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    out = [
        (torch.randn(4, 16, generator=g).half(), torch.randn(4, 16, generator=g)) for _ in range(8)
    ]
    out[3] = (torch.full((4, 16), float("inf")).half(), out[3][1])  # an overflowing step
    return out


def _steps(monkeypatch):
    # A scale that fits from the start and grows every 2 clean steps: growth, one overflow
    # (batch 3) and its backoff all happen within the 8 steps.
    monkeypatch.setattr(sync, "INIT_SCALE", 2.0**8)
    monkeypatch.setattr(sync, "GROWTH_INTERVAL", 2)
    return {
        "host": sync.HostFlagStep(sync.make_model(16, 32, 1, "cpu")),
        "gated": sync.HostGatedStep(sync.make_model(16, 32, 1, "cpu")),
        "device": sync.DeviceFlagStep(sync.make_model(16, 32, 1, "cpu")),
    }


def test_host_reads_per_step(monkeypatch, batches):
    steps = _steps(monkeypatch)
    reads = {k: sync.reads_per_step(step, batches)["python_reads"] for k, step in steps.items()}
    assert reads == {"host": 1.0, "gated": 1.0, "device": 0.0}


def test_the_three_steps_train_identically_through_an_overflow(monkeypatch, batches):
    steps = _steps(monkeypatch)
    start = [p.detach().clone() for p in steps["host"].master.masters]
    for step in steps.values():
        for x, y in batches:
            step(x, y)
    assert steps["host"].master.skipped_steps == 1
    weights, scale = steps["host"].state()
    # interval 2: grows after steps 0-1, backs off at step 3 (the overflow; step 2's clean count
    # is reset), grows after steps 4-5 and 6-7.
    assert scale == 2.0**8 * 2 * 0.5 * 2 * 2
    assert not torch.equal(weights[0], start[0])
    for k in ("gated", "device"):
        w, s = steps[k].state()
        assert s == scale, k
        for a, b in zip(weights, w, strict=True):
            assert torch.equal(a, b), k


def test_counting_restores_tensor_methods():
    before = dict(torch.Tensor.__dict__)
    with sync.count_host_reads() as counts:
        bool(torch.ones(()))
        torch.ones(2).tolist()
    assert counts["python_reads"] == 2
    assert {n: torch.Tensor.__dict__.get(n) for n in sync.HOST_READS} == {
        n: before.get(n) for n in sync.HOST_READS
    }
    assert bool(torch.ones(())) is True
