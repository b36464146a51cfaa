"""Bad ZeRO set-ups fail before any step, naming the value and what would be valid.

One gloo rank is enough for all of them (run once, every check inside).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.zero_workload import tiny_gpt
from llmlab.parallel.data.zero import ZeroEngine
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


class RootOwnsAParameter(nn.Module):
    """A module that runs its blocks *and* uses a parameter of its own around them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x * self.scale


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def checks(rank: int, world: int) -> dict[str, str]:
    out = {}
    out["stage"] = _message(lambda: ZeroEngine(tiny_gpt(), stage=4))
    out["root"] = _message(lambda: ZeroEngine(RootOwnsAParameter(), stage=3))
    mixed = tiny_gpt()
    mixed.blocks[0].attn.qkv.weight.data = mixed.blocks[0].attn.qkv.weight.data.double()
    out["dtypes"] = _message(lambda: ZeroEngine(mixed, stage=1))

    model = tiny_gpt()
    engine = ZeroEngine(model, stage=2)
    foreign = torch.optim.AdamW([*model.parameters(), nn.Parameter(torch.ones(3))])
    out["foreign"] = _message(lambda: engine.rewire(foreign))
    used = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    used.step()
    out["state"] = _message(lambda: engine.rewire(used))
    out["pipeline3"] = _message(lambda: ZeroEngine(tiny_gpt(), stage=3, reduce_in_backward=False))
    return out


def test_misconfigurations_are_named() -> None:
    out = run_distributed(checks, 1)[0]
    assert "ZeRO stage must be one of (0, 1, 2, 3), got 4" in out["stage"]
    assert "module <root> (RootOwnsAParameter) owns parameters ['scale']" in out["root"]
    assert "mixes dtypes ['torch.float32', 'torch.float64']" in out["dtypes"]
    assert "holds a parameter of shape (3,) that this ZeroEngine does not manage" in out["foreign"]
    assert "needs a fresh optimizer, but it already holds state" in out["state"]
    assert "must reduce in backward too (reduce_in_backward=True)" in out["pipeline3"]
