"""The run's model summary shows real FLOPs or none (``llmlab.train.summary.ModelSummary``).

Lightning's summary, without an ``example_input_array``, prints a FLOPs column of zeros and
"Total FLOPs: 0". Ours drops both and prints the model's analytic training FLOPs per token
(the figure MFU uses); when Lightning did measure (an ``example_input_array``), its column
and total stay. The callback runs through Lightning's own ``on_fit_start`` on a real
``Trainer``; the table is read from rich's console output.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from rich.console import Console

from llmlab.train.summary import ModelSummary
from tests.helpers.tiny import quiet_trainer, tiny_task


def _printed(module: L.LightningModule, monkeypatch: pytest.MonkeyPatch) -> str:
    console = Console(record=True, width=200)
    monkeypatch.setattr("rich.get_console", lambda: console)
    callback = ModelSummary(max_depth=2)
    trainer = quiet_trainer(callbacks=[callback])
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    return console.export_text()


def test_language_model_summary_shows_flops_per_token_and_no_zero_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = tiny_task()
    text = _printed(task, monkeypatch)
    assert "Params" in text and "model.embed" in text  # the table itself is there
    assert "FLOPs " not in text.splitlines()[1]  # header row: no FLOPs column
    assert "Total FLOPs" not in text
    want = get_human_readable_count(int(task.model.flops_per_token()))
    assert f"Training FLOPs per token (model.flops_per_token): {want}" in text
    assert want != "0"


class _Plain(L.LightningModule):
    def __init__(self, example: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        if example:
            self.example_input_array = torch.zeros(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_model_without_a_flop_count_gets_no_flops_line(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _printed(_Plain(example=False), monkeypatch)
    assert "layer" in text and "Linear" in text
    assert "FLOPs" not in text


def test_measured_flops_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an example input Lightning counts the forward: 2·B·in·out = 2·2·8·4 = 128."""
    text = _printed(_Plain(example=True), monkeypatch)
    assert "FLOPs" in text.splitlines()[1]
    assert "Total FLOPs (measured): 128" in text
