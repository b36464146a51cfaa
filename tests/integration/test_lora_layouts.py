"""LoRA under llmlab's layouts trains like one process (issue 39): data = 2, tensor = 2 (plain, with
sequence parallelism, with activation checkpointing), pipeline = 2, context = 2 (also with
FSDP2), FSDP2 and llmlab's ZeRO-3 over data = 2, and on four ranks pairs of dimensions (pipeline
× tensor, context × tensor, data × tensor with FSDP2 and with ZeRO-3 + sequence parallelism, data
× pipeline with ZeRO-1; ``slow``: eight ranks, data × pipeline × tensor and data × context ×
tensor + SP). Each starts from the same ``model.init_from`` folder (a tiny byte-level Llama: GQA,
gated MLP, untied head) with adapters on every linear layer, is built through the app's own
config (``compose_config`` → ``validate_config`` → ``build_strategy`` / ``build_precision``) and
trains in a real ``Trainer`` (``tests.helpers.training.fit``).

Per step the logged ``train/loss`` and ``train/grad_norm`` and the first step's independently
computed master-gradient norm must equal the single-process run's within 1e-5 (absolute; the
layouts only sum in another order: measured ≤ 9.6e-7 on the loss and ≤ 6e-7 on the norm).
Each layout's trainable tensors are checked too: split where the layout splits them, held by the
stage that owns the layer, and the only thing the optimizer steps. ``B`` starts random
(``init_lora_weights: false``), so ``A``'s gradient is non-zero from the first step and a
mis-reduced ``A`` half (the replicated one of each sharded pair) shows at once; the clip at 0.5
makes every step's update depend on the global norm.

The checkpoint holds the adapters alone (the base is the folder), consolidated by name: saved
under tensor = 2 it resumes under data = 2, under FSDP2 and in one process (the N-D strategy on
one rank, and Lightning's own: its optimizer state by name lists the parameters in the order one
process's optimizer holds them), and Lightning's one-process checkpoint (by position) resumes
under tensor = 2, as does pipeline = 2's sharded folder (the adapters' shards), each
continuing the uninterrupted single-process curve within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_tiny import byte_level_llama_folder
from tests.helpers.nd import close
from tests.helpers.training import save_at_step

pytestmark = pytest.mark.distributed

LORA = "+task.lora={r: 4, alpha: 8, target_modules: all-linear, init_lora_weights: false}"
STEPS, HALF, CLIP = 4, 2, 0.5  # resume: two epochs of HALF batches, saved after the first
LAYOUTS: dict[str, list[str]] = {
    "data2": ["strategy=nd"],
    "tensor2": ["strategy=tensor"],
    "tensor2-sp": ["strategy=tensor_sp"],
    "pipeline2": [
        "strategy=pipeline",
        "strategy.microbatches=2",
        "strategy.timeline_every_n_steps=0",
    ],
    "fsdp2": ["strategy=nd", "strategy.zero=3", "strategy.zero_impl=fsdp2"],
    "tensor2-ac": ["strategy=tensor", "+model_transforms.activation_checkpointing=1"],
    "zero3": ["strategy=nd", "strategy.zero=3"],  # llmlab's: the adapters sharded, base whole
    "context2": ["strategy=nd", "strategy.context=2"],
    "context2-fsdp2": ["strategy=nd", "strategy.context=2", "strategy.zero=3",
                       "strategy.zero_impl=fsdp2"],  # FSDP2 over data × context
    # four ranks: each pair of dimensions
    "pipeline2xtensor2": ["strategy=nd", "strategy.pipeline=2", "strategy.tensor=2",
                          "strategy.microbatches=2", "strategy.timeline_every_n_steps=0"],
    "data2xtensor2-fsdp2": ["strategy=nd", "strategy.tensor=2", "strategy.zero=3",
                            "strategy.zero_impl=fsdp2"],
    "data2xtensor2-sp-zero3": ["strategy=nd", "strategy.tensor=2", "strategy.zero=3",
                               "strategy.sequence_parallel=true"],
    "context2xtensor2": ["strategy=nd", "strategy.context=2", "strategy.tensor=2"],
    # eight ranks (slow): data × pipeline × tensor, data × context × tensor + SP
    "data2xpipeline2xtensor2": ["strategy=nd", "strategy.data=2", "strategy.pipeline=2",
                                "strategy.tensor=2", "strategy.microbatches=2",
                                "strategy.timeline_every_n_steps=0"],
    "data2xcontext2xtensor2-sp": ["strategy=nd", "strategy.data=2", "strategy.context=2",
                                  "strategy.tensor=2", "strategy.sequence_parallel=true"],
    "data2xpipeline2-zero1": ["strategy=nd", "strategy.pipeline=2", "strategy.zero=1",
                              "strategy.microbatches=2", "strategy.timeline_every_n_steps=0"],
}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return byte_level_llama_folder(tmp_path_factory.mktemp("init") / "tiny-llama")[1]


def _config(path: str, layout: list[str], devices: int):
    from omegaconf import OmegaConf

    from llmlab.train.app import compose_config, validate_config
    from llmlab.train.pretrained import resolve_init_from

    cfg = compose_config(
        ["experiment=llama_finetune", f"model.init_from={path}", "model.block_size=16", LORA,
         "data.batch_size=8", f"trainer.devices={devices}", *layout]
    )  # fmt: skip
    resolve_init_from(cfg)
    OmegaConf.set_struct(cfg, False)
    return cfg, validate_config(cfg, tokenizer_vocab=256)


def _fit(path: str, layout: list[str], devices: int, **kwargs) -> dict:
    """One run of ``layout`` on this process's world (``fit`` of the matrix helpers)."""
    from omegaconf import OmegaConf

    from tests.helpers.training import fit_config

    cfg, run = _config(path, layout, devices)
    lora = OmegaConf.to_container(cfg.task.lora, resolve=True)
    out = fit_config(cfg, run, devices, steps=STEPS, batches=HALF, clip=CLIP,
                     task_kwargs={"lora": lora}, **kwargs)  # fmt: skip
    return {**{k: out[k] for k in ("losses", "norms", "master_norm")}, **_held(out["trainer"])}


def _held(trainer) -> dict:
    """This rank's trainable tensors (local shapes) and what its optimizer steps."""
    from llmlab.parallel.norm import local_tensor

    model = trainer.lightning_module.model
    held = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not p.is_meta]
    trainable = {
        n.replace("._checkpoint_wrapped_module", ""): tuple(local_tensor(p).shape) for n, p in held
    }  # fmt: skip  (other stages': meta; a checkpointed block's)
    ids = {id(p) for _, p in held}
    engine = getattr(trainer.strategy, "zero_engine", None)  # ZeRO steps pieces of the params
    masters = getattr(trainer.precision_plugin, "masters", None)  # or their fp32 masters
    owner = engine.model_param_of() if engine is not None else {}
    owner = owner or (masters.model_param_of() if masters is not None else {})
    stepped = {id(owner.get(id(p), p)) for g in trainer.optimizers[0].param_groups
               for p in g["params"]}  # fmt: skip
    only = stepped == ids if engine is None else bool(stepped) and stepped <= ids
    return {"trainable": trainable, "optimizer_holds_only_them": only}


def _layouts(rank: int, world: int, path: str, names: list[str]) -> dict:
    return {name: _fit(path, LAYOUTS[name], world) for name in names}


def _reference(path: str, save: str | None = None) -> dict:
    callbacks = [save_at_step(HALF, save)] if save else []
    return _fit(path, ["strategy=auto"], 1, callbacks=callbacks)


# A column-parallel base's B and a row-parallel base's A are split over tensor = 2; FSDP2 splits
# every adapter's rows over data = 2; a pipeline stage holds its own blocks' adapters.
SPLIT = {
    "tensor2": {"q_proj.lora_B": 0, "o_proj.lora_A": 1, "down_proj.lora_A": 1},
    "tensor2-sp": {"q_proj.lora_B": 0, "o_proj.lora_A": 1, "down_proj.lora_A": 1},
    "tensor2-ac": {"q_proj.lora_B": 0, "o_proj.lora_A": 1, "down_proj.lora_A": 1},
    "fsdp2": {"q_proj.lora_A": 0, "q_proj.lora_B": 0, "o_proj.lora_B": 0},
    "pipeline2xtensor2": {"q_proj.lora_B": 0, "o_proj.lora_A": 1},
    "context2xtensor2": {"q_proj.lora_B": 0, "o_proj.lora_A": 1},
    "data2xpipeline2xtensor2": {"q_proj.lora_B": 0, "o_proj.lora_A": 1},
}


def _check(name: str, got: dict, want: dict) -> None:
    assert got["optimizer_holds_only_them"], name
    for part, dim in SPLIT.get(name, {}).items():
        key = f"blocks.0.attn.{part}.weight".replace("attn.down", "mlp.down")
        assert got["trainable"][key][dim] * 2 == want["trainable"][key][dim], (name, key)
    if name.startswith("pipeline2"):
        assert not any(k.startswith("blocks.1.") for k in got["trainable"]), got["trainable"]
    close(got["losses"], want["losses"], f"{name} loss")
    close(got["norms"], want["norms"], f"{name} train/grad_norm")
    close([got["master_norm"]], [want["master_norm"]], f"{name} master norm")


@pytest.mark.parametrize(
    ("world", "names"),
    [
        (2, ["data2", "fsdp2", "zero3", "context2", "context2-fsdp2"]),
        (2, ["tensor2", "tensor2-sp", "tensor2-ac", "pipeline2"]),
        (4, ["pipeline2xtensor2", "data2xtensor2-fsdp2", "data2xtensor2-sp-zero3",
             "context2xtensor2", "data2xpipeline2-zero1"]),
        pytest.param(8, ["data2xpipeline2xtensor2", "data2xcontext2xtensor2-sp"],
                     marks=pytest.mark.slow),
    ],
    ids=["dp-fsdp2-zero", "tp-pp", "4-ranks", "8-ranks"],
)  # fmt: skip
def test_lora_trains_like_one_process(folder, world, names):
    want = _reference(str(folder))
    assert all(b > 0 for b in want["norms"])
    got = run_distributed(_layouts, world, str(folder), names)[0]
    for name in names:
        _check(name, got[name], want)


def _resume(rank: int, world: int, path: str, root: str) -> dict:
    tp_ckpt = f"{root}/tensor2.ckpt"
    tensor = _fit(path, LAYOUTS["tensor2"], world, callbacks=[save_at_step(HALF, tp_ckpt)])
    data = _fit(path, LAYOUTS["data2"], world, ckpt_path=tp_ckpt)
    fsdp2 = _fit(path, LAYOUTS["fsdp2"], world, ckpt_path=tp_ckpt)
    from_one = _fit(path, LAYOUTS["tensor2"], world, ckpt_path=f"{root}/one.ckpt")
    # sharded (a DCP folder of the adapters): written by pipeline stages, read by tensor ranks
    folder = f"{root}/pipeline2-sharded.ckpt"
    nd = ["strategy=nd", "strategy.sharded_checkpoints=true", "strategy.timeline_every_n_steps=0"]
    stages = [*nd, "strategy.pipeline=2", "strategy.microbatches=2"]
    _fit(path, stages, world, callbacks=[save_at_step(HALF, folder)])
    from_shards = _fit(path, [*nd, "strategy.tensor=2"], world, ckpt_path=folder)
    return {"tensor2": tensor, "data2<-tensor2": data, "fsdp2<-tensor2": fsdp2,
            "tensor2<-one": from_one, "tensor2<-pipeline2-sharded": from_shards}  # fmt: skip


def _resume_alone(rank: int, world: int, path: str, ckpt: str) -> dict:
    return _fit(path, ["strategy=nd"], world, ckpt_path=ckpt)


def test_adapters_only_checkpoint_resumes_in_another_layout(folder, tmp_path):
    from llmlab.models.lora import lora_state_dict
    from llmlab.train.sample import load_checkpoint

    want = _reference(str(folder), save=str(tmp_path / "one.ckpt"))
    got = run_distributed(_resume, 2, str(folder), str(tmp_path))[0]
    tp_ckpt = str(tmp_path / "tensor2.ckpt")  # and in one process of the N-D strategy
    got["one<-tensor2"] = run_distributed(_resume_alone, 1, str(folder), tp_ckpt)[0]
    got["auto<-tensor2"] = _fit(str(folder), ["strategy=auto"], 1, ckpt_path=tp_ckpt)
    _check("tensor2", got["tensor2"], want)
    resumed = ["data2<-tensor2", "fsdp2<-tensor2", "tensor2<-one", "one<-tensor2",
               "auto<-tensor2", "tensor2<-pipeline2-sharded"]  # fmt: skip
    for name in resumed:
        close(got[name]["losses"], want["losses"][HALF:], f"{name} resumed loss")
        close(got[name]["norms"], want["norms"][HALF:], f"{name} resumed train/grad_norm")

    # Every checkpoint: the adapters alone, at full shape, by the unsplit model's names (the
    # sharded folder too); the tensor-parallel one loads into a plain model with the
    # one-process run's adapters.
    one, tp = (torch.load(tmp_path / f, weights_only=False) for f in ("one.ckpt", "tensor2.ckpt"))
    assert sorted(tp["state_dict"]) == sorted(one["state_dict"])
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tp["state_dict"])
    from llmlab.parallel.checkpoint.files import metadata

    saved = [
        k
        for k in metadata(tmp_path / "pipeline2-sharded.ckpt").state_dict_metadata
        if k.startswith("model.")
    ]  # fmt: skip  (the DCP folder: its model keys)
    assert sorted(saved) == sorted(tp["state_dict"])
    model, _ = load_checkpoint(str(tmp_path / "tensor2.ckpt"))
    for key, value in lora_state_dict(model).items():
        torch.testing.assert_close(value, one["state_dict"][f"model.{key}"], atol=1e-5, rtol=0)


GPT_LORA = {"r": 4, "alpha": 8, "init_lora_weights": False, "target_modules": "all-linear"}
GPT_LAYOUTS = {"pipeline2": {"pipeline": 2, "microbatches": 2}, "tensor2-sp": {"tensor": 2,
               "sequence_parallel": True}}  # fmt: skip


def _gpt_fit(layout: dict | None, world: int, save: str | None = None) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy
    from tests.helpers.tiny import tiny_gpt_config
    from tests.helpers.training import fit

    strategy = "auto" if layout is None else NDParallelStrategy(**layout, timeline_every_n_steps=0)
    model = tiny_gpt_config(n_head=4, dropout=0.0)
    out = fit(strategy, world, model, steps=3, clip=CLIP, task_kwargs={"lora": GPT_LORA})
    if save:
        out["trainer"].save_checkpoint(save)
    return {k: out[k] for k in ("losses", "norms", "master_norm")}


def _gpt_layouts(rank: int, world: int, root: str) -> dict:
    return {name: _gpt_fit(layout, world, f"{root}/{name}.ckpt") for name, layout in
            GPT_LAYOUTS.items()}  # fmt: skip


def test_lora_on_a_tied_gpt_from_scratch(tmp_path):
    """The GPT ties its embedding to its LM head (frozen: the tie is summed over the stages only
    when it trains) and fuses q, k, v in one column-parallel layer; from a random base there is
    no folder, so the checkpoint holds the whole model, gathered like any other."""
    want = _gpt_fit(None, 1)
    got = run_distributed(_gpt_layouts, 2, str(tmp_path))[0]
    for name in GPT_LAYOUTS:
        close(got[name]["losses"], want["losses"], f"gpt {name} loss")
        close(got[name]["norms"], want["norms"], f"gpt {name} train/grad_norm")
        close([got[name]["master_norm"]], [want["master_norm"]], f"gpt {name} master norm")
        state = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)["state_dict"]
        assert state["model.blocks.0.attn.qkv.base_layer.weight"].shape == (96, 32), name
        assert state["model.blocks.1.attn.qkv.lora_B.weight"].shape == (96, 4), name


HALF_PRECISIONS = ("bf16_master", "fp16_master")  # fp32 masters of the adapters alone


def _precisions(rank: int, world: int, path: str) -> dict:
    return {p: _fit(path, [*LAYOUTS["tensor2"], f"precision={p}"], world) for p in HALF_PRECISIONS}


def test_lora_in_half_precision_under_tensor_parallelism(folder):
    """A bf16 / fp16 base (frozen, no masters) with fp32 masters for the adapters: tensor = 2
    within the composition matrix's tolerance for the precision (relative; it rounds shards and
    sums differently; measured 1e-3 / 4e-2 (bf16) and 1e-4 / 6e-3 (fp16) on loss / norm)."""
    from tests.integration.composition_cells import TOLERANCES

    got = run_distributed(_precisions, 2, str(folder))[0]
    for precision in HALF_PRECISIONS:
        want = _fit(str(folder), ["strategy=auto", f"precision={precision}"], 1)
        loss_rel, norm_rel = TOLERANCES[precision]
        for what, rel in (("losses", loss_rel), ("norms", norm_rel)):
            tol = dict(atol=0, rtol=rel)
            close(got[precision][what], want[what], f"{precision} {what}", tol)
        assert got[precision]["optimizer_holds_only_them"], precision
