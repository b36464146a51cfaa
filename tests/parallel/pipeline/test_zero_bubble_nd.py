"""ZB-H1, ZB-V and DualPipeV through the N-D strategy: 10 steps of a real ``lightning.Trainer``.

Oracle: single-process Lightning training of the same task on the same global batches, with the
same gradient clipping and the real ``TrainingTelemetry`` callback (``tests.parallel.test_nd``'s
``fit``). Every layout must give, at each of 10 steps, the same loss and the same logged
``train/grad_norm`` within 1e-5 (fp32). The loss of a V-shaped schedule comes from pipeline rank
0 (the last virtual stage is there), and validation runs the V's forward-only schedule, so both
paths of the V placement are exercised. Gradient-level agreement with
``torch.distributed.pipelining``'s own ZB schedules is in ``test_zero_bubble_engine.py``.

Default suite: one 4-rank spawn with a GPT PP×TP = 2×2 ZB-V (tensor-parallel chunks in a V), a
GPT DP×PP = 2×2 ZB-H1 with ZeRO-1 (the optimizer shards and the data reduction after W), and a
Llama DP×PP = 2×2 DualPipeV with every block activation-checkpointed (one shared recompute for B
and W). The slow matrix: every schedule on GPT and Llama over 2 and 4 stages, ZB-V with sequence
parallelism and with fp16 master weights (the loss scale reaches B and W).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.parallel.test_nd import CLIP, LLAMA, MODEL, STEPS, _close, _nd_runs, fit

GPT6 = {**MODEL, "n_layer": 6}  # [embed, 6 blocks, head]: 8 virtual stages for a V over 4 ranks
LLAMA6 = {**LLAMA, "n_layer": 6}


def _reference(model: dict) -> dict:
    run = fit("auto", 1, STEPS, model=model)
    assert min(run["norms"]) > CLIP, run["norms"]  # clipping acts at every step
    return run


def _check(results: list[dict], cases: list[dict], references: dict[str, dict]) -> None:
    for case in cases:
        ref = references[case["ref"]]
        for rank, r in enumerate(results):
            got = r[case["name"]]
            _close(got["losses"], ref["losses"], f"{case['name']} loss (rank {rank})")
            _close(got["norms"], ref["norms"], f"{case['name']} train/grad_norm (rank {rank})")


@pytest.mark.distributed
def test_split_schedules_in_nd_strategy_match_one_process(tmp_path: Path) -> None:
    cases = [
        {"name": "gpt-pp2tp2-zbv", "ref": "gpt",
         "layout": dict(pipeline=2, tensor=2, schedule="zbv", microbatches=4)},
        {"name": "gpt-dp2pp2-zb1-zero1", "ref": "gpt",
         "layout": dict(data=2, pipeline=2, schedule="zb1", microbatches=2, zero=1)},
        {"name": "llama-dp2pp2-dualpipev-ac", "ref": "llama", "model": LLAMA,
         "layout": dict(data=2, pipeline=2, schedule="dualpipev", microbatches=4,
                        transforms=dict(activation_checkpointing=1))},
    ]  # fmt: skip
    references = {"gpt": _reference(MODEL), "llama": _reference(LLAMA)}
    results = run_distributed(_nd_runs, 4, str(tmp_path), cases, timeout=1500)
    _check(results, cases, references)


def _matrix_cases(pipeline: int) -> list[dict]:
    """Every split schedule on GPT and Llama, ``pipeline`` stages × data = 4 / pipeline."""
    m = 8 if pipeline == 4 else 4  # DualPipeV needs 2p micro-batches; BATCH 8 / data rows each
    data = 4 // pipeline
    models = {"gpt": GPT6, "llama": LLAMA6} if pipeline == 4 else {"gpt": MODEL, "llama": LLAMA}
    if data > 1:
        m = 4  # 4 rows per replica: DualPipeV's 2p = 4 micro-batches of one row
    return [
        {"name": f"{kind}-pp{pipeline}-{schedule}", "ref": f"{kind}{pipeline}",
         "model": models[kind],
         "layout": dict(data=data, pipeline=pipeline, schedule=schedule, microbatches=m)}
        for kind in ("gpt", "llama")
        for schedule in ("zb1", "zbv", "dualpipev")
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pipeline", [2, 4])
def test_every_split_schedule_on_gpt_and_llama(tmp_path: Path, pipeline: int) -> None:
    cases = _matrix_cases(pipeline)
    if pipeline == 2:
        from functools import partial

        from llmlab.parallel.precision.plugins import FP16MasterPrecision

        cases += [
            {"name": "gpt-pp2tp2-zbv-sp", "ref": "gpt2",
             "layout": dict(pipeline=2, tensor=2, schedule="zbv", microbatches=4,
                            sequence_parallel=True)},
            {"name": "gpt-dp2pp2-zbv-fp16", "ref": "gpt2",
             "precision": partial(FP16MasterPrecision, growth_interval=2),
             "layout": dict(data=2, pipeline=2, schedule="zbv", microbatches=4)},
        ]  # fmt: skip
    models = {"gpt": GPT6, "llama": LLAMA6} if pipeline == 4 else {"gpt": MODEL, "llama": LLAMA}
    references = {f"{k}{pipeline}": _reference(model) for k, model in models.items()}
    results = run_distributed(_nd_runs, 4, str(tmp_path), cases, timeout=3000)
    _check(results, cases, references)
