"""The model summary that opens every run: Lightning's rich table, without FLOPs it never measured.

Lightning counts FLOPs only by running ``example_input_array`` through the model at fit start,
on rank zero alone. The tasks here set none on purpose: after the strategy has split or sharded
the model, a forward on one rank is wrong (a pipeline stage takes activations, not token ids)
or hangs (a tensor-parallel layer waits for its peers). Without it Lightning prints a FLOPs
column of zeros and "Total FLOPs: 0", which reads as a measurement. This summary drops the
column unless something was counted, and prints instead the model's own analytic training
FLOPs per token (``flops_per_token()``, e.g. ``6N + 12·L·d·T`` for the GPT, the figure MFU is
computed from), read in ``setup`` while the model is still whole. A model without that method
(ResNet-50) gets no FLOPs line at all.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn


class ModelSummary(RichModelSummary):
    """``RichModelSummary`` that shows real FLOPs or none (see the module docstring)."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.flops_per_token: float | None = None
        self.quantized_bytes: tuple[int, int] | None = None  # (held, fp32 equivalent)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls this before the strategy's setup: the model is still whole here.
        count = getattr(getattr(pl_module, "model", None), "flops_per_token", None)
        if self.flops_per_token is None and callable(count):
            self.flops_per_token = float(count())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a quantized base (QLoRA) holds its weights in buffers, which Lightning's "params
        # size" never counts: the bytes held and their fp32 size, read once the task built it
        from llmlab.models.quantize import (
            QuantizedEmbedding,
            QuantizedLinear,
            float_weight_bytes,
            weight_bytes,
        )

        model = getattr(pl_module, "model", None)
        if isinstance(model, nn.Module) and any(
            isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()
        ):
            self.quantized_bytes = (weight_bytes(model), float_weight_bytes(model))
        super().on_fit_start(trainer, pl_module)

    def summarize(  # type: ignore[override]  # an instance method: it reads flops_per_token
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        if not total_flops:  # nothing was measured: a column of zeros would be a false figure
            summary_data = [(name, cells) for name, cells in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in summary_data:
            right = name not in (" ", "Name", "Type", "Mode")
            table.add_column(name, justify="right" if right else "left", no_wrap=name == "Name")
        for row in zip(*(cells for _, cells in summary_data)):
            table.add_row(*row)
        console = get_console()
        console.print(table)

        frozen = total_parameters - trainable_parameters
        lines = [
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(frozen))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", f"{model_size:,.3f}"),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ]
        if self.quantized_bytes:
            held, wide = self.quantized_bytes
            lines.append((
                "Weights held, quantized base (MB)",
                f"{held / 1e6:,.3f} (with an fp32 base: {wide / 1e6:,.3f}, {held / wide:.2f}x)",
            ))  # fmt: skip
        if total_flops:
            lines.append(("Total FLOPs (measured)", get_human_readable_count(total_flops)))
        if self.flops_per_token:
            count = get_human_readable_count(int(self.flops_per_token))
            lines.append(("Training FLOPs per token (model.flops_per_token)", count))
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in lines:
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)
