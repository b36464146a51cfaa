"""Every supported cell of the composition matrix trains like one process (issues 15, 24).

``composition_cells.CELLS`` is the one list (its refusals are checked against
``validate_config`` on the whole config space by ``test_composition_space.py``). A supported
cell trains 3 optimizer steps in a real ``Trainer`` with the real ``CausalLMTask`` (a tiny GPT
or Llama), built from the app's own config (``compose_config`` → ``validate_config`` →
``build_strategy`` / ``build_precision`` → ``hand_model_transforms``), and is compared with the
single-process run (``strategy=auto``) of the same model, precision, memory, kernels and compile
settings.

What a supported cell must match, per step (``TOLERANCES``, relative, per precision): the loss
curve, the logged ``train/grad_norm`` (the real ``TrainingTelemetry``), and the first step's
master-gradient norm computed independently from the optimizer's gradients
(``tests.helpers.training``). Each tolerance is far below 2× (the smallest error a wrong
reduction, a missing loss scale or a rank-local metric makes: the ones issue 15 found were 2×,
1.6× and 65,536×) and above what the layout's own rounding does: fp32 sums in a different order
(measured ≤ 1e-5), bf16 / fp16 / fp8 round micro-batches and shards differently.

Two axes change what a cell runs:

* ``checkpoint=sharded``: 4 steps over two epochs of 2 batches; a second run stops after the
  first epoch and saves (every rank its shards), a third resumes from that folder and must
  continue the uninterrupted curve within ``RESUME_TOLERANCE`` (same layout, same arithmetic);
  the uninterrupted run is compared with one process as above.
* ``kernels=triton``: the cells run in processes started with ``TRITON_INTERPRET=1`` (set before
  triton is imported), so the Triton kernels themselves run under Triton's interpreter — the
  single-process reference too. Each such cell reports what ran: the interpreter live, the
  kernel modules imported, and no op that fell back to the PyTorch reference (asserted).

Default suite (``default_cells``): the cells issue 24 names (``REQUIRED``) and a pairwise cover
of the supported cells with the PyTorch kernels, eager and consolidated checkpoints (every pair
of axis values those cells have, in at least one run cell; asserted here). ``slow``: a pairwise
cover of every supported cell (compile, interpreter and sharded resume included) and every
supported cell. DeepSpeed's own master norm lives inside its engine, so for it only the loss
curve and its logged norm are compared; the asynchronous parameter server logs no gradient norm
(its servers reply one only in sync mode: ``train/grad_norm`` is NaN), so for it only the loss
curve and the master norm are.
"""

from __future__ import annotations

import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.training import save_at_step
from tests.integration.composition_cells import (
    CELLS,
    CHEAP,
    REQUIRED,
    RESUME_TOLERANCE,
    STEPS,
    TOLERANCES,
    Cell,
    _pairs,
    default_cells,
    pairwise_cells,
    supported_cells,
)

RESUME_STEPS, HALF = 4, 2  # a sharded cell: two epochs of HALF batches, saved after the first


# --------------------------------------------------------------------------- running cells
def _schedule(cell: Cell) -> tuple[int, int]:
    """(steps, batches per epoch) the cell and its reference train."""
    return (RESUME_STEPS, HALF) if cell.checkpoint == "sharded" else (STEPS, STEPS)


def _triton_evidence() -> dict:
    """What ran the ``kernels=triton`` ops in this process: whether Triton's interpreter is
    live, which kernel modules were imported (only a Triton launch imports one), and which ops
    fell back to the PyTorch reference."""
    from llmlab.kernels import _runtime

    live = _runtime.interpreter_requested() and "triton" in sys.modules
    return {
        "interpreter": live and _runtime._interpreter_live(),
        "kernels": sorted(m for m in sys.modules if m.startswith("llmlab.kernels._jit.")),
        "fallbacks": sorted(_runtime._warned_ops),
    }


Job = tuple[Cell, tuple[int, int]]  # a cell and its (steps, batches per epoch)


def _key(job: Job) -> str:
    cell, (steps, batches) = job
    return f"{cell.id}@{steps}x{batches}"


def _fit_cell(cell: Cell, root: str, schedule: tuple[int, int]) -> dict:
    from omegaconf import OmegaConf

    from llmlab.parallel.checkpoint import is_sharded
    from llmlab.train.app import compose_config, validate_config
    from tests.helpers.training import fit_config

    cfg = compose_config(cell.overrides())
    OmegaConf.set_struct(cfg, False)
    run = validate_config(cfg)
    steps, batches = schedule

    def train(**kwargs) -> dict:
        return fit_config(cfg, run, cell.devices, steps=steps, batches=batches, **kwargs)

    sharded = cell.checkpoint == "sharded"
    path = os.path.join(root, f"{cell.id}.ckpt")
    full = train(callbacks=[save_at_step(HALF, path)] if sharded else [])
    out = {k: full[k] for k in ("losses", "norms", "master_norm")}
    if sharded:
        resumed = train(ckpt_path=path)
        out["resumed"] = {"losses": resumed["losses"], "norms": resumed["norms"],
                          "sharded": is_sharded(path)}  # fmt: skip
    if cell.interpreted:
        out["triton"] = _triton_evidence()
    return out


def _run_jobs(rank: int, world: int, jobs: list[Job], root: str) -> dict[str, dict]:
    return {_key(job): _fit_cell(job[0], root, job[1]) for job in jobs}


@contextmanager
def _interpreter(on: bool):
    """``TRITON_INTERPRET=1`` in the environment the spawned ranks start with."""
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if on and old is None:
            os.environ.pop("TRITON_INTERPRET")
        elif on:
            os.environ["TRITON_INTERPRET"] = old


# --------------------------------------------------------------------------- checking
def _close(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for a, b in zip(got, want, strict=True):
        assert math.isfinite(a) and abs(a - b) <= rel * abs(b), (what, got, want, rel)


def _check(cell: Cell, got: dict, want: dict) -> None:
    loss_rel, norm_rel = TOLERANCES[cell.precision]
    _close(got["losses"], want["losses"], loss_rel, f"{cell.id} loss")
    if cell.strategy != "ps_async":  # async servers reply no whole-gradient norm: NaN logged
        _close(got["norms"], want["norms"], norm_rel, f"{cell.id} train/grad_norm")
    if cell.strategy != "deepspeed":
        _close([got["master_norm"]], [want["master_norm"]], norm_rel, f"{cell.id} master norm")
    if cell.checkpoint == "sharded":
        resumed = got["resumed"]
        assert resumed["sharded"], f"{cell.id}: the checkpoint is not a folder of shards"
        _close(resumed["losses"], got["losses"][HALF:], RESUME_TOLERANCE, f"{cell.id} resumed loss")
        _close(resumed["norms"], got["norms"][HALF:], RESUME_TOLERANCE, f"{cell.id} resumed norm")
    if cell.interpreted:
        _check_triton(cell.id, got["triton"])


def _check_triton(what: str, evidence: dict) -> None:
    assert evidence["interpreter"] and evidence["kernels"] and not evidence["fallbacks"], (
        f"{what}: kernels=triton did not run the Triton kernels under the interpreter: {evidence}"
    )


def _run(jobs: list[Job], devices: int, interpreted: bool, root: Path) -> dict[str, dict]:
    """The jobs in turn: here (one process, PyTorch kernels) or in one spawn of ``devices``
    ranks (started with ``TRITON_INTERPRET=1`` for the Triton kernels)."""
    if (devices, interpreted) == (1, False):
        return _run_jobs(0, 1, jobs, str(root))
    with _interpreter(interpreted):
        return run_distributed(_run_jobs, devices, jobs, str(root), timeout=3000)[0]


def check_cells(cells: list[Cell], root: Path) -> None:
    """Refused cells: the message. Supported: one run per (world size, interpreter) trains its
    cells in turn, each compared with its single-process reference (run once per setting)."""
    from llmlab.train.app import ConfigError, compose_config, validate_config

    for cell in cells:
        if cell.refused:
            with pytest.raises(ConfigError, match=re.escape(cell.refused)):
                validate_config(compose_config(cell.overrides()))
    supported = [c for c in cells if not c.refused]
    references = {(c.reference(), _schedule(c)) for c in supported}
    want: dict[str, dict] = {}
    for interpreted in (False, True):
        jobs = sorted((j for j in references if j[0].interpreted == interpreted), key=_key)
        want |= _run(jobs, 1, interpreted, root) if jobs else {}
    failures = []
    for devices, interpreted in sorted({(c.devices, c.interpreted) for c in supported}):
        jobs = [
            (c, _schedule(c))
            for c in supported
            if (c.devices, c.interpreted) == (devices, interpreted)
        ]
        results = _run(jobs, devices, interpreted, root)
        for cell, schedule in jobs:
            ref = want[_key((cell.reference(), schedule))]
            try:
                if cell.interpreted:
                    _check_triton(f"reference of {cell.id}", ref["triton"])
                _check(cell, results[_key((cell, schedule))], ref)
            except AssertionError as err:
                failures.append(str(err))
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- tests
def _covered(cells: list[Cell]) -> set:
    return set().union(*(_pairs(c) for c in cells))


def test_the_default_and_pairwise_cells_cover_every_pair() -> None:
    """Default suite: ``REQUIRED`` and every pair of the PyTorch-kernel, eager, consolidated
    supported cells; ``slow``: every pair of every supported cell."""
    cheap = [c for c in supported_cells() if all(getattr(c, a) == v for a, v in CHEAP.items())]
    assert default_cells()[: len(REQUIRED)] == REQUIRED
    assert _covered(default_cells()) >= _covered(cheap)
    assert _covered(pairwise_cells()) == _covered(supported_cells())
    assert len(supported_cells()) + sum(bool(c.refused) for c in CELLS) == len(CELLS)
    assert all(not c.refused for c in REQUIRED), [c.id for c in REQUIRED if c.refused]


@pytest.mark.parametrize("precision", list(TOLERANCES))
def test_the_tolerances_reject_a_2x_error(precision: str) -> None:
    """The control: each comparison fails on a 2× loss, logged norm or master norm."""
    cell = Cell("gpt", "ddp", "zero0", precision, "none", "torch", "eager", "consolidated")
    want = {"losses": [4.2, 4.1, 4.0], "norms": [1.0, 0.8, 0.6], "master_norm": 1.0}
    _check(cell, want, want)
    for key in want:
        bad = {**want, key: [2 * x for x in want[key]] if key != "master_norm" else 2.0}
        with pytest.raises(AssertionError):
            _check(cell, bad, want)


def test_a_resume_off_the_curve_or_a_reference_run_in_place_of_triton_fails() -> None:
    """The controls of the two new checks: a resumed loss 1e-4 off the uninterrupted curve, a
    single-file checkpoint, and a ``kernels=triton`` run that fell back to the PyTorch
    reference (or never imported a kernel) are each an error."""
    cell = Cell("gpt", "nd-dp2", "zero1", "fp32", "none", "triton", "eager", "sharded")
    curve = {"losses": [4.2, 4.1, 4.0, 3.9], "norms": [1.0, 0.8, 0.6, 0.5], "master_norm": 1.0}
    ran = {"interpreter": True, "kernels": ["llmlab.kernels._jit.layernorm"], "fallbacks": []}
    good = {**curve, "resumed": {"losses": [4.0, 3.9], "norms": [0.6, 0.5], "sharded": True},
            "triton": ran}  # fmt: skip
    _check(cell, good, curve)
    bad_resumes = [{"losses": [4.0004, 3.9]}, {"sharded": False}]
    bad_kernels = [{"fallbacks": ["layer_norm"]}, {"kernels": []}, {"interpreter": False}]
    for change in bad_resumes:
        with pytest.raises(AssertionError):
            _check(cell, {**good, "resumed": {**good["resumed"], **change}}, curve)
    for change in bad_kernels:
        with pytest.raises(AssertionError):
            _check(cell, {**good, "triton": {**ran, **change}}, curve)


@pytest.mark.distributed
@pytest.mark.timeout(3600)
def test_default_cells_match_one_process(tmp_path: Path) -> None:
    """The cells issue 24 names — Llama × 3-D × fp16_master, ZeRO-3 × fp8, compile × ZeRO-3,
    Triton-interpreter kernels × TP+SP and × pipeline, sharded save and resume × every
    precision — and the pairwise cover of the PyTorch-kernel, eager, consolidated cells."""
    check_cells(default_cells(), tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(4 * 3600)
def test_pairwise_cells_match_one_process(tmp_path: Path) -> None:
    check_cells(pairwise_cells(), tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(0)
def test_every_supported_cell_matches_one_process(tmp_path: Path) -> None:
    check_cells(supported_cells(), tmp_path)


def test_the_docs_table_is_the_one_generated_from_cells() -> None:
    """docs/composing-strategies.md shows ``composition_table.table()`` verbatim."""
    from tests.integration.composition_table import table

    root = Path(__file__).resolve().parents[2]
    for doc in ("docs/composing-strategies.md",):
        text = (root / doc).read_text()
        assert table() in text, f"{doc}: run `python -m tests.integration.composition_table`"
