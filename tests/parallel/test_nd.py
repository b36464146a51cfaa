"""``NDParallelStrategy`` in a real ``lightning.Trainer`` with the real ``CausalLMTask``.

Oracle: single-process Lightning training (``strategy="auto"``) of the same task on the same
global batches, with the same gradient clipping (low enough that it clips every step) and the
real ``TrainingTelemetry`` callback. Every layout must give, at each of 10 steps, the same loss
and the same logged ``train/grad_norm`` within 1e-5 (fp32), and the same final weights within
1e-5 in its consolidated checkpoint. A control run that skips the data-parallel reduction must
fail the same comparison, so the comparison can fail.

How ranks run: ``run_distributed`` (gloo) gives each rank a process in which it builds its own
``Trainer`` (Lightning sees the external process group and does not re-launch), so one spawn
runs several fits in turn.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.nd import (
    BATCH,
    CLIP,
    HALF,
    LLAMA,
    MODEL,
    STEPS,
    TOL,
    T,
    check_final_weights,
    close,
    fit,
    global_batches,
    nd_runs,
)
from tests.parallel.tensor.common import tp_step_bytes


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process Lightning on the global batches: losses, logged norms, final weights."""
    run = fit("auto", 1, STEPS)
    norms = run["norms"]
    assert min(norms) > CLIP, norms  # clipping really acts at every step
    model = run["trainer"].lightning_module.model
    return {
        "losses": run["losses"],
        "norms": norms,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _analytical_tp(chunks: list[tuple[bool, int, bool]], sp: bool, m: int, data: int) -> int:
    """Payload bytes one rank's tensor parallelism moves per step: the README's formula
    (``tp_step_bytes``) for each piece it holds, with b = BATCH / data rows per replica and
    ``m`` micro-batches where a collective runs per backward."""
    return sum(
        sum(tp_step_bytes(rows=BATCH // data, seq=T, width=MODEL["n_embd"], layers=L, sp=sp,
                          microbatches=m, embedding=e, head=h).values())
        for e, L, h in chunks
    )  # fmt: skip


def _analytical_pp(sp: bool) -> float:
    """Payload bytes one rank's pipeline moves per step at DP × PP × TP = 2 × 2 × 2, 1F1B:
    stage 0 sends b·T·C activations, the last stage b·T·C gradients (÷ tp under SP: sequence
    shards), and both all-reduce their copy of the tied embedding shard (V/tp × C)."""
    tp, b, C, V = 2, BATCH // 2, MODEL["n_embd"], MODEL["vocab_size"]
    return b * T * C * 4 / (tp if sp else 1) + V // tp * C * 4


def _check_tp_comm(results: list[dict], cases: dict[str, dict]) -> set[tuple[bool, bool]]:
    """Every rank's logged ``comm/tp_bytes`` of each case in ``cases`` (name -> sp, m, data)
    equals the formula; returns the stage shapes (embedding?, head?) it covered."""
    shapes = set()
    for r in results:
        for name, c in cases.items():
            got, chunks = r[name]["comm"]["comm/tp_bytes"], r[name]["chunks"]
            want = _analytical_tp(chunks, c["sp"], c["m"], c["data"])
            assert got == want, (name, r[name]["coords"], chunks, got, want)
            shapes.update((e, h) for e, _, h in chunks)
    return shapes


def _expected_shares() -> tuple[int, int]:
    """The model's parameter count, and its duplicates across one data replica at PP × TP =
    2 × 2: the tied embedding's second copy (V × C, on the last stage) and, for every parameter
    tensor parallelism replicates (position table, norms, row-parallel biases), tp - 1 copies."""
    from llmlab.models import GPT, GPTConfig

    model = GPT(GPTConfig(**MODEL))
    total = sum(p.numel() for p in model.parameters())
    sharded = ("wte", "qkv", "attn.proj.weight", "mlp.fc", "mlp.proj.weight")
    replicated = sum(
        p.numel() for n, p in model.named_parameters() if not any(s in n for s in sharded)
    )
    return total, MODEL["vocab_size"] * MODEL["n_embd"] + (2 - 1) * replicated


@pytest.mark.distributed
def test_3d_2x2x2_equals_single_process_and_checkpoints_into_other_layouts(
    reference: dict, tmp_path: Path
) -> None:
    layout = dict(data=2, pipeline=2, tensor=2, schedule="1f1b", microbatches=2)
    cases = [
        {"name": "3d", "layout": dict(layout, sequence_parallel=True), "save": "3d.ckpt"},
        {"name": "half", "layout": layout, "steps": HALF, "save": "half.ckpt"},
        {"name": "control", "layout": layout, "control": True},
    ]
    results = run_distributed(nd_runs, 8, str(tmp_path), cases, timeout=1500)
    for r in results:  # every rank logs the global loss and the global norm
        close(r["3d"]["losses"], reference["losses"], "3d loss")
        close(r["3d"]["norms"], reference["norms"], "3d train/grad_norm")
        close(r["half"]["losses"], reference["losses"][:HALF], "half loss")
    check_final_weights(tmp_path / "3d.ckpt", reference)
    with pytest.raises(AssertionError):  # the control skips a reduction: it must not pass
        close(results[0]["control"]["losses"], reference["losses"], "control")

    # Each rank holds only its shard: one replica's shares add up to the model + duplicates.
    total, duplicates = _expected_shares()
    replica = [r["3d"]["params"] for r in results if r["3d"]["coords"][0] == 0]
    assert len(replica) == 4 and max(replica) < total / 2
    assert sum(replica) == total + duplicates
    # The comm bytes of one step equal the analytical count, per dimension: first and last
    # stage, with and without sequence parallelism.
    shapes = _check_tp_comm(
        results, {"3d": dict(sp=True, m=2, data=2), "half": dict(sp=False, m=2, data=2)}
    )
    assert shapes == {(True, False), (False, True)}, shapes
    for r in results:
        got = r["3d"]["comm"]
        assert got["comm/pp_bytes"] == _analytical_pp(sp=True), (r["3d"]["coords"], got)
        assert got["comm/dp_bytes"] == 4 * r["3d"]["params"]

    # Resume the 2×2×2 checkpoint of step 5 as PP × TP (1×2×2) and DP × TP (2×1×2): the curve
    # continues the single-process one. And PP × TP with the interleaved schedule from scratch.
    cases = [
        {"name": "1x2x2", "layout": dict(pipeline=2, tensor=2, microbatches=2),
         "resume": "half.ckpt"},
        {"name": "2x1x2", "layout": dict(data=2, tensor=2), "resume": "half.ckpt"},
        {"name": "pp2tp2", "layout": dict(pipeline=2, tensor=2, schedule="interleaved",
                                          microbatches=2)},
    ]  # fmt: skip
    results = run_distributed(nd_runs, 4, str(tmp_path), cases, timeout=1500)
    for r in results:
        for name in ("1x2x2", "2x1x2"):
            close(r[name]["losses"], reference["losses"][HALF:], f"resumed {name} loss")
            close(r[name]["norms"], reference["norms"][HALF:], f"resumed {name} grad_norm")
        close(r["pp2tp2"]["losses"], reference["losses"], "pp2tp2 interleaved loss")
        close(r["pp2tp2"]["norms"], reference["norms"], "pp2tp2 interleaved grad_norm")
    # tensor-parallel bytes of every stage shape: one stage holding both ends (2x1x2), and
    # first + middle, middle + last chunks (interleaved: two virtual stages per rank)
    shapes = _check_tp_comm(
        results,
        {
            "1x2x2": dict(sp=False, m=2, data=1),
            "2x1x2": dict(sp=False, m=1, data=2),
            "pp2tp2": dict(sp=False, m=2, data=1),
        },
    )
    assert shapes == {(True, True), (True, False), (False, False), (False, True)}, shapes


MATRIX_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("data", [2, 1], ids=["2x2x2", "1x2x2"])
def test_every_schedule_with_and_without_sequence_parallel_equals_single_process(
    reference: dict, tmp_path: Path, data: int
) -> None:
    """The full matrix of issue 14: DP × PP × TP = 2×2×2 and PP × TP = 2×2, each schedule, ± SP:
    losses, logged grad norms and final consolidated weights against one process."""
    cases = [
        {
            "name": f"{schedule}-sp{int(sp)}",
            "layout": dict(
                data=data,
                pipeline=2,
                tensor=2,
                schedule=schedule,
                microbatches=2,
                sequence_parallel=sp,
            ),
            "save": f"{schedule}-sp{int(sp)}.ckpt",
        }
        for schedule in MATRIX_SCHEDULES
        for sp in (False, True)
    ]
    results = run_distributed(nd_runs, 4 * data, str(tmp_path), cases, timeout=2400)
    layouts = {c["name"]: c["layout"] for c in cases}
    shapes = _check_tp_comm(
        results,
        {n: dict(sp=c["sequence_parallel"], m=2, data=data) for n, c in layouts.items()},
    )
    assert (False, False) in shapes  # interleaved: a middle chunk, with and without SP
    for case in cases:
        name = case["name"]
        for r in results:
            close(r[name]["losses"], reference["losses"], f"{name} loss")
            close(r[name]["norms"], reference["norms"], f"{name} train/grad_norm")
        check_final_weights(tmp_path / case["save"], reference)


@pytest.mark.distributed
def test_llama_with_grouped_query_attention_in_pp_x_tp_and_dp_x_tp(tmp_path: Path) -> None:
    """Llama (RoPE, RMSNorm, SwiGLU, 4 query heads on 2 KV heads, untied head) goes through the
    same contracts: PP × TP = 2 × 2 (1F1B, with and without SP) and DP × TP = 2 × 2 follow its
    single-process run at every step, losses within 1e-6 and logged grad norms within 1e-9.
    Both sides train in float64 (``64-true``): in fp32 rounding alone moves this model's norm
    up to 5e-5 by step 10 in any layout (plain DP = 2, the same average in another summation
    order, is 6.7e-6 off; TP = 2 alone 2.8e-5) because AdamW at lr 1e-2 turns rounding in its
    smallest gradients, the q/k projections' while attention is near uniform, into full-size
    steps. fp64 starts that amplification ~9 digits lower, so no step needs an allowance (the
    loss bound is one fp32 ulp: the recorded loss is cast to fp32)."""
    from lightning.pytorch.plugins.precision import DoublePrecision

    run = fit("auto", 1, STEPS, model=LLAMA, plugins=[DoublePrecision()])
    assert min(run["norms"]) > CLIP, run["norms"]
    cases = [
        {"name": "pp2tp2", "model": LLAMA,
         "layout": dict(pipeline=2, tensor=2, schedule="1f1b", microbatches=2)},
        {"name": "pp2tp2-sp", "model": LLAMA,
         "layout": dict(pipeline=2, tensor=2, schedule="1f1b", microbatches=2,
                        sequence_parallel=True)},
        {"name": "dp2tp2", "model": LLAMA, "layout": dict(data=2, tensor=2)},
    ]  # fmt: skip
    cases = [{**case, "precision": DoublePrecision} for case in cases]
    results = run_distributed(nd_runs, 4, str(tmp_path), cases, timeout=1500)
    for r in results:
        for case in cases:
            got, name = r[case["name"]], f"llama {case['name']}"
            close(got["losses"], run["losses"], f"{name} loss", dict(atol=1e-6, rtol=0))
            close(got["norms"], run["norms"], f"{name} grad_norm", dict(atol=1e-9, rtol=0))


# ---------------------------------------------------------------------- sharded checkpoints
# Sharded Trainer checkpoints of the N-D strategy (issue 16): each rank writes only its shards,
# and any other layout (data, pipeline, tensor degree, ZeRO stage) resumes from them.
#
# Oracles: the uninterrupted run (a resume in the same layout continues its curve within 1e-6;
# in another layout within 1e-6 relative: see LAYOUT_TOL), the consolidated checkpoint the same
# layout writes without ``sharded_checkpoints`` (equal bit for bit once consolidated), and the
# single-process model (the plain GPT's logits within 1e-4, as ``check_final_weights``).
#
# A 2×2×2 checkpoint cannot resume as 1×2×2 with ``zero=3``: ZeRO-2/3 with a pipeline is refused
# up front (``nd_options.ZERO_WITH_PIPELINE``), so the step-5 shards resume as 1×2×2 ``zero=1``
# (another data and ZeRO layout under the same pipeline), 2×1×2 ``zero=3`` and 4×1×1 ``zero=2``.

RESUME_TOL = dict(atol=1e-6, rtol=0)  # same layout: measured bit-exact
# Another layout sums in another order: measured 9.5e-7 on losses of 4.1 (2 fp32 ulps), 1.2e-7 on
# norms, so 1e-6 relative.
LAYOUT_TOL = dict(atol=0.0, rtol=1e-6)
LAYOUT_3D = dict(data=2, pipeline=2, tensor=2, schedule="1f1b", microbatches=2, zero=1)


def _chunk_cover(path: Path) -> dict[str, tuple[int, int]]:
    """key -> (elements written over all chunks, elements of the tensor)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from llmlab.parallel.checkpoint import metadata

    out = {}
    for key, meta in metadata(path).state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            written = sum(int(torch.Size(c.sizes).numel()) for c in meta.chunks)
            out[key] = (written, int(meta.size.numel()))
    return out


def _fp16_master_cases() -> list[dict]:
    """data × tensor = 2×2 with fp16 weights and fp32 masters: a run whose loss scale grows
    every 2 steps (so the scaler's state changes the curve) saved and resumed as is, and a run
    with the default scaler saved without ZeRO and resumed at ``zero=1``."""
    from functools import partial

    from llmlab.parallel.precision.plugins import FP16MasterPrecision

    growing = partial(FP16MasterPrecision, growth_interval=2)
    layout = dict(data=2, tensor=2, sharded_checkpoints=True)
    return [
        {"name": "fp16-full", "layout": layout, "precision": growing},
        {"name": "fp16-half", "layout": layout, "precision": growing, "steps": HALF,
         "save": "fp16-half.ckpt"},
        {"name": "fp16-resumed", "layout": layout, "precision": growing,
         "resume": "fp16-half.ckpt"},
        {"name": "fp16d-full", "layout": layout, "precision": FP16MasterPrecision},
        {"name": "fp16d-half", "layout": layout, "precision": FP16MasterPrecision, "steps": HALF,
         "save": "fp16d-half.ckpt"},
        {"name": "fp16-zero1", "layout": dict(layout, zero=1), "precision": FP16MasterPrecision,
         "resume": "fp16d-half.ckpt"},
    ]  # fmt: skip


def _llama_cases() -> list[dict]:
    """Llama GQA at PP × TP = 2 × 2, interleaved (two chunks per rank), every block wrapped by
    activation checkpointing: saved sharded at step 5, resumed as is and as DP × TP ZeRO-1."""
    layout = dict(
        pipeline=2,
        tensor=2,
        schedule="interleaved",
        microbatches=2,
        transforms=dict(activation_checkpointing=1),
        sharded_checkpoints=True,
    )
    return [
        {"name": "ll-full", "layout": layout, "model": LLAMA},
        {"name": "ll-half", "layout": layout, "model": LLAMA, "steps": HALF,
         "save": "ll-half.ckpt"},
        {"name": "ll-resumed", "layout": layout, "model": LLAMA, "resume": "ll-half.ckpt"},
        {"name": "ll-dp2tp2-zero1", "layout": dict(data=2, tensor=2, zero=1), "model": LLAMA,
         "resume": "ll-half.ckpt"},
    ]  # fmt: skip


def _plain_gpt(state: dict):
    from llmlab.models import GPT, GPTConfig

    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.distributed
def test_2x2x2_zero1_sharded_checkpoint_resumes_in_other_layouts_and_consolidates(
    reference: dict, tmp_path: Path
) -> None:
    sharded = dict(LAYOUT_3D, sharded_checkpoints=True)
    cases = [
        {"name": "full", "layout": sharded, "save": "full.ckpt"},
        {"name": "half", "layout": sharded, "steps": HALF, "save": "half.ckpt"},
        {"name": "resumed", "layout": sharded, "resume": "half.ckpt"},
        {"name": "consolidated", "layout": LAYOUT_3D, "save": "consolidated.ckpt"},
        {"name": "zero0", "layout": dict(sharded, zero=0), "steps": 1, "save": "zero0.ckpt"},
    ]
    results = run_distributed(nd_runs, 8, str(tmp_path), cases, timeout=1500)

    # Each of the 8 ranks wrote its own shard file, and every element of every tensor (weights,
    # AdamW moments) was written exactly once: the chunks tile each tensor. Without ZeRO the data
    # replicas hold equal copies, and they share the writing.
    half = tmp_path / "half.ckpt"
    for path in (half, tmp_path / "zero0.ckpt"):
        shard_files = sorted(p.name for p in path.glob("*.distcp"))
        assert len(shard_files) == 8, shard_files
        cover = _chunk_cover(path)
        assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in cover)
        for key, (written, numel) in cover.items():
            assert written == numel, (path.name, key, written, numel)
        sizes = [(path / f).stat().st_size for f in shard_files]
        assert min(sizes) > 0 and max(sizes) < sum(sizes) / 3, (path.name, sizes)
    shard_files = sorted(p.name for p in half.glob("*.distcp"))

    # Resumed in the same layout, the run continues the uninterrupted curve.
    for r in results:
        close(r["resumed"]["losses"], r["full"]["losses"][HALF:], "resumed loss", tol=RESUME_TOL)
        close(r["resumed"]["norms"], r["full"]["norms"][HALF:], "resumed grad_norm", tol=RESUME_TOL)

    # Consolidated (the CLI, one process, no group) it is the plain GPT the consolidated
    # checkpoint of the same run holds, bit for bit, and decodes like the single-process model.
    out = tmp_path / "full.pt"
    cli = subprocess.run(
        [sys.executable, "-m", "llmlab.parallel.checkpoint", "consolidate",
         str(tmp_path / "full.ckpt"), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    from_shards = torch.load(out, weights_only=True)
    consolidated = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)["state_dict"]
    consolidated = {k.removeprefix("model."): v for k, v in consolidated.items()}
    assert from_shards.keys() == consolidated.keys()
    for k, v in consolidated.items():
        assert torch.equal(from_shards[k], v), k
    x = global_batches(1, 7)[0, :, :-1]
    with torch.no_grad():
        logits = _plain_gpt(from_shards)(x)
        torch.testing.assert_close(logits, _plain_gpt(reference["state"])(x), atol=1e-4, rtol=0)

    # The sampler reads the folder as it is.
    from llmlab.parallel.checkpoint.torch_file import checkpoint_problem
    from llmlab.train.sample import load_checkpoint

    sampled, _ = load_checkpoint(str(tmp_path / "full.ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(sampled(x), logits, atol=0, rtol=0)

    # The step-5 shards resume in other layouts and ZeRO stages; each continues the curve.
    cases = [
        {"name": "1x2x2-zero1", "layout": dict(pipeline=2, tensor=2, microbatches=2, zero=1),
         "resume": "half.ckpt"},
        {"name": "2x1x2-zero3", "layout": dict(data=2, tensor=2, zero=3), "resume": "half.ckpt"},
        {"name": "4x1x1-zero2", "layout": dict(data=4, zero=2), "resume": "half.ckpt"},
        *_fp16_master_cases(),
        *_llama_cases(),
    ]  # fmt: skip
    full = results[0]["full"]  # every rank logs the global loss and norm
    results = run_distributed(nd_runs, 4, str(tmp_path), cases, timeout=1500)
    for r in results:
        for name in ("1x2x2-zero1", "2x1x2-zero3", "4x1x1-zero2"):
            close(r[name]["losses"], full["losses"][HALF:], f"{name} loss", tol=LAYOUT_TOL)
            close(r[name]["norms"], full["norms"][HALF:], f"{name} grad_norm", tol=LAYOUT_TOL)
        # fp16 with fp32 masters: the masters and the loss scaler come back, not the fp16
        # weights (resuming from those would miss by ~1e-4); into ZeRO's master shards too.
        for name, uninterrupted in (("fp16-resumed", "fp16-full"), ("fp16-zero1", "fp16d-full")):
            close(r[name]["losses"], r[uninterrupted]["losses"][HALF:], name, tol=RESUME_TOL)
            close(r[name]["norms"], r[uninterrupted]["norms"][HALF:], name, tol=RESUME_TOL)
        # Llama (untied, GQA), interleaved virtual stages, checkpoint-wrapped blocks: resumed as
        # is (exact) and as data × tensor with ZeRO-1 (the Llama N-D test's 1e-5 on losses).
        for name in ("ll-resumed", "ll-dp2tp2-zero1"):
            tol = RESUME_TOL if name == "ll-resumed" else TOL
            close(r[name]["losses"], r["ll-full"]["losses"][HALF:], name, tol=tol)
        close(r["ll-resumed"]["norms"], r["ll-full"]["norms"][HALF:], "ll norms", tol=RESUME_TOL)
        assert r["fp16-full"]["loss_scale"] > 2.0**16  # the scale grew: its state matters
        assert r["fp16-resumed"]["loss_scale"] == r["fp16-full"]["loss_scale"]

    # The resume check accepts the folder and names what is wrong with a damaged one.
    assert checkpoint_problem(half) is None
    first = half / shard_files[0]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    assert "truncated" in checkpoint_problem(half)
    first.unlink()
    assert f"lacks the shard file {shard_files[0]}" in checkpoint_problem(half)
