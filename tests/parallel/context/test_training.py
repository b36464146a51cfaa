"""Context parallelism in the N-D strategy: a real ``Trainer`` with the real ``CausalLMTask``.

Oracle: single-process Lightning training on the same global batches (``tests.helpers.training``:
gradient clipping that acts every step, the real ``TrainingTelemetry``). With
``context=2`` and with data × context × tensor = 2 × 2 × 2, every rank's logged loss (the whole
sequence's) and ``train/grad_norm`` must match it at each of 10 steps within 1e-5 (fp32), the
consolidated checkpoint's weights within 1e-5, and ``comm/cp_bytes`` must equal
``micro-batches × cp_bytes(...)`` to the byte. The control averages gradients over the data group
only -- it skips the context part of the folded reduction -- and must fail the same comparison.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import tiny_gpt_config

MODEL = tiny_gpt_config(n_layer=4, n_head=4, dropout=0.0)
LLAMA = dict(
    arch="llama", vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=96, dropout=0.0,
)  # fmt: skip
STEPS, BATCH, T, CLIP = 10, 8, 16, 0.05  # clipping acts at every step (asserted)
TOL = dict(atol=1e-5, rtol=0)
# The task's warmup (as test_nd's): AdamW's first step is lr·g/(|g|+eps) for every element,
# whatever its gradient's size, so it is the step that turns rounding in near-zero gradients
# into the largest weight differences; at full lr from step 1 one GPT weight ended 1.24e-5 off.
WARMUP = 1
EPS = 1e-6


def fit(strategy, devices: int, steps: int = STEPS, model: dict = MODEL) -> dict:
    """10 clipped steps on whole (unpadded) batches: over that many AdamW steps the rounding of
    unequal per-rank token counts grows past 1e-5 in the Llama's norm (4e-5 by step 6); the
    composition matrix checks padded batches on context layouts for 3 steps at 1e-5."""
    from tests.helpers.training import fit as fit_steps

    return fit_steps(strategy, devices, model, steps=steps, clip=CLIP, warmup_steps=WARMUP,
                     eps=EPS, padded=False)  # fmt: skip


def _close(got: list[float], want: list[float], what: str, tol: dict = TOL) -> None:
    assert len(got) == len(want), (what, got)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol, msg=what)


def _single_process(model: dict) -> dict:
    run = fit("auto", 1, model=model)
    assert min(run["norms"]) > CLIP, run["norms"]
    state = run["trainer"].lightning_module.model.state_dict()
    return {**run, "state": {k: v.detach().clone() for k, v in state.items()}}


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process Lightning on the same global batches: losses, logged norms, weights."""
    return _single_process(MODEL)


def _check_final_weights(path: Path, reference: dict) -> None:
    """The consolidated checkpoint holds the unsplit model's names and one process's values."""
    saved = torch.load(path, weights_only=False)["state_dict"]
    diffs = {k: float((saved[f"model.{k}"] - v).abs().max()) for k, v in reference["state"].items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL["atol"], (worst, diffs[worst])


def _runs(rank: int, world: int, root: str, cases: list[dict]) -> dict:
    from llmlab.parallel.pipeline.grad_sync import GradientReducer
    from llmlab.parallel.strategy import NDParallelStrategy

    class SkipsContextReduction(NDParallelStrategy):
        """The control: gradients averaged over the data group only, not data × context."""

        def _connect_mechanisms(self, trainer) -> None:
            super()._connect_mechanisms(trainer)
            groups, parallel = self.groups, self.parallel
            self._reducer = GradientReducer(
                parallel.params, parallel.tied, groups.data, self.dims.data
            )

    out = {}
    for case in cases:
        os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment teardown removes it
        cls = SkipsContextReduction if case.get("control") else NDParallelStrategy
        strategy = cls(**case["layout"], timeline_every_n_steps=0)
        run = fit(strategy, world, case.get("steps", STEPS), case.get("model", MODEL))
        if case.get("save"):
            run["trainer"].save_checkpoint(os.path.join(root, case["save"]))
        out[case["name"]] = {
            "losses": run["losses"],
            "norms": run["norms"],
            "comm": dict(strategy.last_comm),
            "coords": strategy.groups.coords,
            "state": {
                k: v.detach().clone()
                for k, v in strategy.lightning_module.model.state_dict().items()
            }
            if case.get("state")
            else None,
        }
    return out


def _expected_cp_bytes(model: dict, data: int, tensor: int, context: int) -> int:
    from llmlab.parallel.context import cp_bytes

    kv = model.get("n_kv_head", model["n_head"])
    return cp_bytes(
        batch=BATCH // data,
        kv_heads=kv // tensor,
        seq_len=T,
        head_dim=model["n_embd"] // model["n_head"],
        degree=context,
        dtype=torch.float32,
        layers=model["n_layer"],
    )  # one micro-batch per step


def _check_cp_bytes(results: list[dict], name: str, model: dict, **layout: int) -> None:
    want = _expected_cp_bytes(
        model, layout.get("data", 1), layout.get("tensor", 1), layout["context"]
    )
    for r in results:
        assert r[name]["comm"]["comm/cp_bytes"] == want, (name, r[name]["coords"], want)


@pytest.mark.distributed
def test_context_2_gpt_and_llama_equal_single_process(
    reference: dict,
    tmp_path: Path,
) -> None:
    llama_ref = _single_process(LLAMA)
    llama_state = llama_ref["state"]
    cases = [
        {"name": "gpt", "layout": dict(context=2), "save": "cp2.ckpt"},
        {"name": "llama", "layout": dict(context=2), "model": LLAMA, "state": True},
        {"name": "control", "layout": dict(context=2), "control": True, "steps": 2},
    ]
    results = run_distributed(_runs, 2, str(tmp_path), cases, timeout=900)
    for r in results:  # both context ranks log the whole sequence's loss and the global norm
        _close(r["gpt"]["losses"], reference["losses"], "cp2 gpt loss")
        _close(r["gpt"]["norms"], reference["norms"], "cp2 gpt train/grad_norm")
        _close(r["llama"]["losses"], llama_ref["losses"], "cp2 llama loss")
        _close(r["llama"]["norms"], llama_ref["norms"], "cp2 llama grad_norm")
    _check_final_weights(tmp_path / "cp2.ckpt", reference)
    for k, v in results[0]["llama"]["state"].items():
        torch.testing.assert_close(v, llama_state[k], atol=1e-5, rtol=0, msg=k)
    _check_cp_bytes(results, "gpt", MODEL, context=2)
    _check_cp_bytes(results, "llama", LLAMA, context=2)
    with pytest.raises(AssertionError):  # no context reduction: each rank steps on its share
        _close(results[0]["control"]["norms"], reference["norms"][:2], "control")


LAYOUT_3D = dict(data=2, context=2, tensor=2)


@pytest.mark.distributed
def test_data2_context2_tensor2_gpt_equals_single_process(
    reference: dict,
    tmp_path: Path,
) -> None:
    """Ring attention on local heads (tensor-parallel attention inside each context rank), the
    folded reduction over the data × context group; the control is the context=2 test's."""
    cases = [{"name": "3d", "layout": LAYOUT_3D, "save": "3d.ckpt"}]
    results = run_distributed(_runs, 8, str(tmp_path), cases, timeout=1500)
    for r in results:
        _close(r["3d"]["losses"], reference["losses"], "2x2x2 loss")
        _close(r["3d"]["norms"], reference["norms"], "2x2x2 train/grad_norm")
    _check_final_weights(tmp_path / "3d.ckpt", reference)
    _check_cp_bytes(results, "3d", MODEL, **LAYOUT_3D)


@pytest.mark.slow
@pytest.mark.distributed
def test_data2_context2_tensor2_llama_equals_single_process_and_control_fails(
    tmp_path: Path,
) -> None:
    """Llama (RoPE at global positions, GQA: one KV head per tensor rank travels) at 2 × 2 × 2,
    and the control at that layout: averaging over the data group only must fail."""
    llama_ref = _single_process(LLAMA)
    cases = [
        {"name": "3d", "layout": LAYOUT_3D, "model": LLAMA, "save": "ll3d.ckpt"},
        {"name": "control", "layout": LAYOUT_3D, "model": LLAMA, "control": True},
    ]
    results = run_distributed(_runs, 8, str(tmp_path), cases, timeout=2400)
    for r in results:
        _close(r["3d"]["losses"], llama_ref["losses"], "2x2x2 llama loss")
        _close(r["3d"]["norms"], llama_ref["norms"], "2x2x2 llama grad_norm")
    _check_cp_bytes(results, "3d", LLAMA, **LAYOUT_3D)
    with pytest.raises(AssertionError):
        _close(results[0]["control"]["norms"], llama_ref["norms"], "control")
    _check_final_weights(tmp_path / "ll3d.ckpt", llama_ref)


@pytest.mark.slow
@pytest.mark.distributed
def test_context_2_with_zero2_over_the_replica_group(
    reference: dict,
    tmp_path: Path,
) -> None:
    """ZeRO-2 shards over the data × context group (here: the 2 context ranks)."""
    cases = [{"name": "zero2", "layout": dict(context=2, zero=2)}]
    for r in run_distributed(_runs, 2, str(tmp_path), cases, timeout=1500):
        _close(r["zero2"]["losses"], reference["losses"], "cp2 zero2 loss")
        _close(r["zero2"]["norms"], reference["norms"], "cp2 zero2 grad_norm")


REFUSED = [
    (["strategy.pipeline=2", "trainer.devices=4"], r"context=2 with pipeline=2: a pipeline stage"),
    (["+model_transforms.recompute_attention=8"], "recompute_attention with context > 1"),
    (["compile=true"], "compile=true with context > 1"),
    (["model.dropout=0.1"], r"model dropout=0.1 with context=2: ring attention has no"),
    (["model.block_size=18"], r"context=2: sequence length 18 is not divisible by 2 × context"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[m[:24] for _, m in REFUSED])
def test_what_context_cannot_run_with_is_refused_before_any_process(
    overrides: list[str], message: str
) -> None:
    """The app's config check (``validate_config``: the strategy's ``check_config``) names each
    combination context parallelism cannot run, before any process or run dir exists."""
    from llmlab.train.app import ConfigError, compose_config, validate_config
    from tests.integration.composition_cells import MODEL as SMALL

    cfg = compose_config([*SMALL, "strategy=nd", "strategy.context=2", "trainer.devices=2",
                          *overrides])  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
