"""The composition matrix's one list of cells (issue 15): every strategy × precision × memory ×
kernels combination, whether it is supported or refused (and why), the tolerances a supported
cell must meet, and a pairwise-covering subset.

Shared by the matrix test (``test_composition_matrix.py``) and the table generator
(``python -m tests.integration.composition_table``), so the table in
docs/composing-strategies.md is printed from exactly the list the test checks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

STEPS = 3
MODEL = [
    "model.vocab_size=64",
    "model.block_size=16",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "data.batch_size=8",
]

# strategy: (processes, config overrides)
STRATEGIES: dict[str, tuple[int, list[str]]] = {
    "auto": (1, ["strategy=auto"]),
    "ddp": (2, ["strategy=ddp"]),
    "bucketed": (2, ["strategy=bucketed", "strategy.bucket_cap_mb=0.01"]),
    "ps_sync": (2, ["strategy=ps_sync"]),
    "pipeline-gpipe": (2, ["strategy=pipeline", "strategy.schedule=gpipe"]),
    "pipeline-1f1b": (2, ["strategy=pipeline", "strategy.schedule=1f1b"]),
    "pipeline-interleaved": (2, ["strategy=pipeline", "strategy.schedule=interleaved"]),
    "tensor": (2, ["strategy=tensor"]),
    "tensor-sp": (2, ["strategy=tensor_sp"]),
    "nd-pp2xtp2": (4, ["strategy=nd", "strategy.pipeline=2", "strategy.tensor=2"]),
    "nd-cp2": (2, ["strategy=nd", "strategy.context=2"]),
    "deepspeed": (2, ["strategy=deepspeed"]),
}
PIPELINE_KEYS = ["strategy.microbatches=2", "strategy.timeline_every_n_steps=0"]
PRECISIONS: dict[str, list[str]] = {
    "fp32": ["precision=fp32"],
    "bf16_mixed": ["precision=bf16_mixed"],
    "bf16_master": ["precision=bf16_master"],
    "fp16_master": ["precision=fp16_master"],
    # 32-wide layers: the filter must admit them (qkv 32→96, fc 32→128, ...), else fp8 refuses
    "fp8": [
        "precision=fp8",
        "precision.plugin.min_features=32",
        "precision.plugin.backend=emulate",
    ],
}
MEMORY: dict[str, list[str]] = {
    "none": [],
    "activation_checkpointing": ["+model_transforms.activation_checkpointing=1"],
    "recompute_attention": ["+model_transforms.recompute_attention=8"],
}
KERNELS: dict[str, list[str]] = {
    "torch": ["model.kernels=torch"],
    "triton": ["model.kernels=triton"],
}
AXES = (tuple(STRATEGIES), tuple(PRECISIONS), tuple(MEMORY), tuple(KERNELS))

# relative tolerance per precision: (loss, grad norms)
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-3),
    "bf16_mixed": (2e-2, 1e-1),
    "bf16_master": (2e-2, 1e-1),
    "fp16_master": (5e-3, 5e-2),
    "fp8": (1e-2, 1e-1),
}

DEEPSPEED_PRECISION = "with strategy=deepspeed is refused"
PS_PRECISION = "cannot run on a parameter server"
CONTEXT_RECOMPUTE = "recompute_attention with context > 1 is refused"
# what each refusal's message must contain -> why, for the table in the docs
WHY_REFUSED = {
    PS_PRECISION: "its servers step the optimizer; the plugin's fp32 masters never would",
    DEEPSPEED_PRECISION: "DeepSpeed's engine steps in its own precision (its bf16 / fp16 config)",
    CONTEXT_RECOMPUTE: "ring attention and recompute attention both replace the attention",
}


def refusal(strategy: str, precision: str, memory: str, kernels: str) -> str | None:
    """The message fragment ``validate_config`` must raise for this cell, or None (supported)."""
    if strategy == "ps_sync" and precision in ("bf16_master", "fp16_master"):
        return PS_PRECISION
    if strategy == "deepspeed" and precision in ("bf16_master", "fp16_master", "fp8"):
        return DEEPSPEED_PRECISION
    if strategy == "nd-cp2" and memory == "recompute_attention":
        return CONTEXT_RECOMPUTE
    return None


@dataclass(frozen=True)
class Cell:
    strategy: str
    precision: str
    memory: str
    kernels: str
    refused: str | None

    @property
    def id(self) -> str:
        return f"{self.strategy}-{self.precision}-{self.memory}-{self.kernels}"

    @property
    def values(self) -> tuple[str, str, str, str]:
        return (self.strategy, self.precision, self.memory, self.kernels)

    @property
    def devices(self) -> int:
        return STRATEGIES[self.strategy][0]

    def overrides(self) -> list[str]:
        devices, strategy = STRATEGIES[self.strategy]
        extra = PIPELINE_KEYS if self.strategy.startswith(("pipeline", "nd-pp")) else []
        return [
            *MODEL,
            *strategy,
            *extra,
            f"trainer.devices={devices}",
            *PRECISIONS[self.precision],
            *MEMORY[self.memory],
            *KERNELS[self.kernels],
        ]

    def reference(self) -> Cell:
        return Cell("auto", self.precision, self.memory, self.kernels, None)


CELLS: list[Cell] = [Cell(*v, refused=refusal(*v)) for v in itertools.product(*AXES)]


def _pairs(cell: Cell) -> set[tuple[int, str, int, str]]:
    v = cell.values
    return {(i, v[i], j, v[j]) for i, j in itertools.combinations(range(len(v)), 2)}


def pairwise(cells: list[Cell]) -> list[Cell]:
    """A greedy pairwise-covering subset: repeatedly take the cell covering the most pairs not
    yet covered (ties: the one with fewer processes, then list order)."""
    wanted = set().union(*(_pairs(c) for c in cells))
    chosen: list[Cell] = []
    while wanted:
        best = max(cells, key=lambda c: (len(_pairs(c) & wanted), -c.devices))
        chosen.append(best)
        wanted -= _pairs(best)
    return chosen


PAIRWISE = pairwise(CELLS)
