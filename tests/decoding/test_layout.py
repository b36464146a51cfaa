"""``llmlab.decoding.layout``: a weight's memory order changes, its values and its outputs do not.

Oracle: the same ``nn.Linear`` products before the change (``torch.allclose``, 1e-6: only the
BLAS summation order differs). Which order is faster is measured on this machine, so the tests
force both outcomes through ``_CHOICES`` instead of relying on a timing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmlab.decoding import layout
from llmlab.decoding.layout import column_major_is_faster, tune_linear_layouts


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.up = nn.Linear(8, 24)
        self.down = nn.Linear(24, 8)
        self.head = nn.Linear(8, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


@pytest.fixture
def choices(monkeypatch):
    """Decide per (out, in) shape which order 'wins', bypassing the timing."""
    table: dict = {}
    monkeypatch.setattr(layout, "_CHOICES", table)
    monkeypatch.setattr(layout, "MIN_BYTES", 0)  # these weights are tiny

    def decide(shapes_to_move: set[tuple[int, int]]) -> None:
        threads = torch.get_num_threads()
        for out, inp in [(24, 8), (8, 24), (40, 8)]:
            table[(out, inp, torch.float32, threads)] = (out, inp) in shapes_to_move

    return decide


def test_moved_weights_keep_values_ties_and_outputs(choices):
    torch.manual_seed(0)
    model = Tied().eval()
    ids = torch.randint(0, 40, (3, 5))
    before = model(ids)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    choices({(24, 8), (40, 8)})
    moved = tune_linear_layouts(model)
    assert moved == ["up.weight", "head.weight"]
    assert model.up.weight.stride() == (1, 24) and model.down.weight.stride() == (24, 1)
    assert model.head.weight is model.embed.weight  # still one tied parameter
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), name
    assert torch.allclose(model(ids), before, rtol=1e-6, atol=1e-6)
    assert tune_linear_layouts(model) == []  # idempotent: already column-major


def test_nothing_moves_when_row_major_wins_and_bad_gain_is_refused(choices):
    model = Tied()
    choices(set())
    assert tune_linear_layouts(model) == []
    assert all(p.is_contiguous() for p in model.parameters())
    with pytest.raises(ValueError, match=r"min_gain must be >= 1\.0"):
        tune_linear_layouts(model, min_gain=0.5)


def test_the_measurement_runs_and_is_cached(monkeypatch):
    monkeypatch.setattr(layout, "_CHOICES", {})
    weight = torch.randn(512, 128)  # 256 KiB: measured (4 copies, 4 sweeps)
    first = column_major_is_faster(weight)
    assert isinstance(first, bool) and len(layout._CHOICES) == 1
    assert column_major_is_faster(torch.randn(512, 128)) is first  # one measurement per shape
    assert column_major_is_faster(torch.randn(64, 64)) is False  # under MIN_BYTES: not measured
    assert len(layout._CHOICES) == 1
