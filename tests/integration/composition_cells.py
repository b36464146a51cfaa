"""The composition matrix's one list of cells (issues 15, 24): every combination of the config
space's axes, whether it is supported or refused (and why), the tolerances a supported cell
must meet, a pairwise-covering subset and the cells the default suite must run.

The config space (what a user picks on the command line): model {gpt, llama} × layout (every
strategy; the N-D strategy as data 2, pipeline 2 × tensor 2, context 2, data 2 × context 2 ×
tensor 2 and data 2 × pipeline 2 × tensor 2) × ZeRO (stage 0-3 × ``zero_impl`` llmlab /
fsdp2; only the N-D layouts take ``strategy.zero``) × precision × memory option × kernels ×
``compile`` × checkpoint format (consolidated / sharded; only the N-D layouts take
``strategy.sharded_checkpoints``). Every other knob keeps its config default. :func:`refusal` is
the single statement of what ``validate_config`` refuses, in the order it checks
(``test_composition_space.py`` asserts it against ``validate_config`` on the whole product, both
ways).

Shared by the matrix tests and the table generator (``python -m
tests.integration.composition_table``), so the table in docs/composing-strategies.md is printed
from exactly the list the tests check.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from functools import cache

STEPS = 3
MODEL = [  # the tiny GPT (tests/parallel/context imports it)
    "model.vocab_size=64",
    "model.block_size=16",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "data.batch_size=8",
]
MODELS: dict[str, list[str]] = {
    "gpt": ["model=gpt", *MODEL],
    # GQA (4 query heads share 2 KV heads), untied head, gated MLP: 32-wide like the GPT
    "llama": ["model=llama", *MODEL, "model.n_kv_head=2", "model.intermediate_size=96"],
}


@dataclass(frozen=True)
class Layout:
    """A strategy as the config spells it: processes, overrides, and whether it is the N-D
    strategy (which alone takes ``strategy.zero`` / ``zero_impl`` / ``sharded_checkpoints``)."""

    devices: int
    overrides: tuple[str, ...]
    nd: bool = False

    @property
    def pipelined(self) -> bool:
        return any(
            o.startswith(("strategy=pipeline", "strategy.pipeline=")) for o in self.overrides
        )


STRATEGIES: dict[str, Layout] = {
    "auto": Layout(1, ("strategy=auto",)),
    "ddp": Layout(2, ("strategy=ddp",)),
    "bucketed": Layout(2, ("strategy=bucketed", "strategy.bucket_cap_mb=0.01")),
    "ps_sync": Layout(2, ("strategy=ps_sync",)),
    "ps_async": Layout(2, ("strategy=ps_async",)),
    "naive_mp": Layout(1, ("strategy=naive_mp",)),
    "pipeline-gpipe": Layout(2, ("strategy=pipeline", "strategy.schedule=gpipe")),
    "pipeline-1f1b": Layout(2, ("strategy=pipeline", "strategy.schedule=1f1b")),
    "pipeline-interleaved": Layout(2, ("strategy=pipeline", "strategy.schedule=interleaved")),
    "tensor": Layout(2, ("strategy=tensor",)),
    "tensor-sp": Layout(2, ("strategy=tensor_sp",)),
    "deepspeed": Layout(2, ("strategy=deepspeed",)),
    "nd-dp2": Layout(2, ("strategy=nd",), nd=True),
    "nd-pp2xtp2": Layout(4, ("strategy=nd", "strategy.pipeline=2", "strategy.tensor=2"), nd=True),
    "nd-cp2": Layout(2, ("strategy=nd", "strategy.context=2"), nd=True),
    "nd-dp2xcp2xtp2": Layout(
        8, ("strategy=nd", "strategy.data=2", "strategy.context=2", "strategy.tensor=2"), nd=True
    ),
    "nd-2x2x2": Layout(
        8, ("strategy=nd", "strategy.pipeline=2", "strategy.tensor=2", "strategy.data=2"), nd=True
    ),
}
PIPELINE_KEYS = ["strategy.microbatches=2", "strategy.timeline_every_n_steps=0"]
ZERO: dict[str, list[str]] = {  # "zero0" (llmlab, off) is every non-N-D strategy's only value
    f"{name}{stage}": [f"strategy.zero={stage}", f"strategy.zero_impl={impl}"]
    for name, impl in (("zero", "llmlab"), ("fsdp2-zero", "fsdp2"))
    for stage in range(4)
}
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
KERNELS: dict[str, list[str]] = {  # triton: run by Triton's interpreter on CPU (the matrix)
    "torch": ["model.kernels=torch"],
    "triton": ["model.kernels=triton"],
}
COMPILE: dict[str, list[str]] = {"eager": ["compile=false"], "compile": ["compile=true"]}
CHECKPOINT: dict[str, list[str]] = {  # sharded: saved mid-run, resumed, compared
    "consolidated": [],
    "sharded": ["strategy.sharded_checkpoints=true"],
}
AXES: dict[str, tuple[str, ...]] = {
    "model": tuple(MODELS),
    "strategy": tuple(STRATEGIES),
    "zero": tuple(ZERO),
    "precision": tuple(PRECISIONS),
    "memory": tuple(MEMORY),
    "kernels": tuple(KERNELS),
    "compile": tuple(COMPILE),
    "checkpoint": tuple(CHECKPOINT),
}
ND_ONLY = {"zero": "zero0", "checkpoint": "consolidated"}  # axis -> the one value elsewhere

# relative tolerance per precision: (logged train/loss, grad norms); fp32's loss: issue 41's 1e-5
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-5, 1e-3),
    "bf16_mixed": (2e-2, 1e-1),
    "bf16_master": (2e-2, 1e-1),
    "fp16_master": (5e-3, 5e-2),
    "fp8": (1e-2, 1e-1),
}
RESUME_TOLERANCE = 1e-5  # resumed in the same layout: the same arithmetic, same order

# what each refusal's message must contain -> why, for the table in the docs
PS_PRECISION = "cannot run on a parameter server"
DEEPSPEED_PRECISION = "with strategy=deepspeed is refused"
NAIVE_MP = "strategy=naive_mp was checked against the unsplit model in fp32 without memory"
CONTEXT_RECOMPUTE = "recompute_attention with context > 1 is refused"
CONTEXT_COMPILE = "compile=true with context > 1 is refused"
COMPILE_UNCHECKED = "compile=true is not supported with strategy"
ZERO_PIPELINE = "is refused: a pipeline runs several micro-batch backward passes"
FSDP2_STAGE = "strategy.zero_impl=fsdp2 expresses ZeRO stages 2"
FSDP2_COMPILE = "strategy.zero_impl=fsdp2 with compile=true is not verified"
FSDP2_AC = "strategy.zero_impl=fsdp2 with activation_checkpointing is not verified"
FSDP2_PLUGIN = "strategy.zero_impl=fsdp2 runs with Lightning's 32-true or bf16-mixed precision"
WHY_REFUSED = {
    PS_PRECISION: "its servers step the optimizer; the plugin's fp32 masters never would",
    DEEPSPEED_PRECISION: "DeepSpeed's engine steps in its own precision (its bf16 / fp16 config)",
    NAIVE_MP: "checked against the unsplit model in fp32 without memory options or compile only",
    CONTEXT_RECOMPUTE: "ring attention and recompute attention both replace the attention",
    CONTEXT_COMPILE: "ring attention's transfers inside compiled blocks were never checked",
    COMPILE_UNCHECKED: "compile was never checked against eager training with this strategy",
    ZERO_PIPELINE: "ZeRO-2/3 would reduce-scatter or gather per micro-batch (DeepSpeed agrees)",
    FSDP2_STAGE: "FSDP2 always reduce-scatters gradients: it expresses ZeRO-2 and ZeRO-3 only",
    FSDP2_COMPILE: "FSDP2 with compile was never checked",
    FSDP2_AC: "FSDP2 with activation checkpointing was never checked",
    FSDP2_PLUGIN: "fp32 master weights and fp8 layers live in llmlab's ZeRO engine, not FSDP2",
}


@dataclass(frozen=True)
class Cell:
    model: str
    strategy: str
    zero: str
    precision: str
    memory: str
    kernels: str
    compile: str
    checkpoint: str

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def id(self) -> str:
        return "-".join(self.values)

    @property
    def layout(self) -> Layout:
        return STRATEGIES[self.strategy]

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def refused(self) -> str | None:
        return refusal(self)

    @property
    def interpreted(self) -> bool:
        """Runs the Triton kernels under ``TRITON_INTERPRET=1`` (set before triton imports)."""
        return self.kernels == "triton"

    def overrides(self) -> list[str]:
        layout = self.layout
        return [
            *MODELS[self.model],
            *layout.overrides,
            *(PIPELINE_KEYS if layout.pipelined else []),
            f"trainer.devices={layout.devices}",
            *(ZERO[self.zero] if layout.nd else []),
            *PRECISIONS[self.precision],
            *MEMORY[self.memory],
            *KERNELS[self.kernels],
            *COMPILE[self.compile],
            *(CHECKPOINT[self.checkpoint] if layout.nd else []),
        ]

    def reference(self) -> Cell:
        """The single-process run of the same model, precision, memory, kernels and compile."""
        return Cell(self.model, "auto", "zero0", self.precision, self.memory, self.kernels,
                    self.compile, "consolidated")  # fmt: skip


def _zero_refusal(c: Cell, layout: Layout) -> str | None:
    """``check_options`` then ``check_config``'s second look (the precision plugin)."""
    stage, fsdp2 = int(c.zero[-1]), c.zero.startswith("fsdp2")
    pipeline = layout.pipelined
    context = "strategy.context=2" in layout.overrides
    if stage >= 2 and pipeline:
        return ZERO_PIPELINE
    if context and c.memory == "recompute_attention":
        return CONTEXT_RECOMPUTE
    if context and c.compile == "compile":
        return CONTEXT_COMPILE
    if not fsdp2:
        return None
    if stage < 2:
        return FSDP2_STAGE
    # (fsdp2 × pipeline never gets here: ZeRO-2/3 with a pipeline is refused first)
    if c.compile == "compile":
        return FSDP2_COMPILE
    if c.memory == "activation_checkpointing":
        return FSDP2_AC
    if c.precision not in ("fp32", "bf16_mixed"):
        return FSDP2_PLUGIN
    return None


def refusal(c: Cell) -> str | None:
    """The message fragment ``validate_config`` must raise for this cell, or None (supported);
    the first refusal in the order the strategy's ``check_config`` looks."""
    s, compiled = c.strategy, c.compile == "compile"
    master = c.precision in ("bf16_master", "fp16_master")
    if s in ("ps_sync", "ps_async"):
        return PS_PRECISION if master else COMPILE_UNCHECKED if compiled else None
    if s == "deepspeed":
        if c.precision not in ("fp32", "bf16_mixed"):
            return DEEPSPEED_PRECISION
        return COMPILE_UNCHECKED if compiled else None
    if s == "naive_mp":
        plain = c.precision == "fp32" and c.memory == "none" and not compiled
        return None if plain else NAIVE_MP
    if STRATEGIES[s].nd:
        return _zero_refusal(c, STRATEGIES[s])
    return None


def space() -> list[Cell]:
    """The whole config space: the product of the axes, with the N-D-only axes at their one
    value for every other strategy."""
    cells = []
    for values in itertools.product(*AXES.values()):
        cell = Cell(*values)
        if not cell.layout.nd and any(getattr(cell, a) != v for a, v in ND_ONLY.items()):
            continue
        cells.append(cell)
    return cells


CELLS: list[Cell] = space()


def _pairs(cell: Cell) -> set[tuple[int, str, int, str]]:
    v = cell.values
    return {(i, v[i], j, v[j]) for i, j in itertools.combinations(range(len(v)), 2)}


def _cost(cell: Cell) -> tuple[int, ...]:
    """What a cell costs to run, for the greedy choice: processes, compile, interpreter, resume."""
    return (cell.compile == "compile", cell.interpreted, cell.checkpoint == "sharded",
            cell.devices)  # fmt: skip


def pairwise(cells: list[Cell], seed: list[Cell] = ()) -> list[Cell]:
    """A greedy pairwise-covering subset: ``seed``, then repeatedly the cell covering the most
    pairs not yet covered (ties: a refused cell, then the cheaper one, then list order)."""
    wanted = set().union(*(_pairs(c) for c in cells)) - set().union(*(_pairs(c) for c in seed))
    chosen: list[Cell] = list(seed)
    while wanted:
        best = max(cells, key=lambda c: (len(_pairs(c) & wanted), bool(c.refused),
                                         tuple(-x for x in _cost(c))))  # fmt: skip
        chosen.append(best)
        wanted -= _pairs(best)
    return chosen


@cache
def supported_cells() -> list[Cell]:
    return [c for c in CELLS if not c.refused]


def _cell(spec: str) -> Cell:
    model, strategy, zero, precision, *rest = spec.split()
    memory, kernels, compile_, checkpoint = (rest + ["none", "torch", "eager", "consolidated"]
                                             [len(rest):])  # fmt: skip
    return Cell(model, strategy, zero, precision, memory, kernels, compile_, checkpoint)


# issue 24's and issue 41's named cells, run by the default suite whatever the pairwise choice
REQUIRED: list[Cell] = [
    _cell("llama nd-2x2x2 zero0 fp16_master"),
    _cell("gpt nd-dp2 zero3 fp8"),
    _cell("gpt nd-dp2 zero3 fp32 none torch compile"),
    # compile with tensor parallelism (the collectives stay out of the compiled graphs)
    _cell("gpt tensor-sp zero0 fp32 none torch compile"),
    _cell("llama nd-pp2xtp2 zero1 fp32 activation_checkpointing torch compile"),
    _cell("gpt tensor-sp zero0 fp32 none triton"),
    _cell("gpt pipeline-1f1b zero0 fp32 none triton"),
    *(_cell(f"gpt nd-dp2 zero1 {p} none torch eager sharded") for p in PRECISIONS),
    # issue 41: the logged loss is the global token mean where ranks count unequal tokens
    _cell("gpt ddp zero0 fp32"),
    _cell("gpt nd-dp2xcp2xtp2 zero0 fp32"),
    _cell("gpt nd-dp2 zero3 fp32"),
    _cell("gpt nd-dp2 fsdp2-zero3 fp32"),
]


CHEAP = {"kernels": "torch", "compile": "eager", "checkpoint": "consolidated"}


@cache
def pairwise_cells() -> list[Cell]:
    """``REQUIRED``, then a greedy pairwise cover of every supported cell (a refused cell
    exercises nothing; every refusal is checked on the whole space by
    test_composition_space.py)."""
    return pairwise(supported_cells(), seed=REQUIRED)


@cache
def default_cells() -> list[Cell]:
    """The default suite's cells: ``REQUIRED`` (which bring the interpreter, compile and the
    sharded resume in), then a pairwise cover of the supported cells with the PyTorch kernels,
    eager and consolidated checkpoints (the cover of every supported cell,
    :func:`pairwise_cells`, is 80 cells with 9 compiled and 22 interpreted ones: ``slow``)."""
    cheap = [c for c in supported_cells() if all(getattr(c, a) == v for a, v in CHEAP.items())]
    return pairwise(cheap, seed=REQUIRED)
