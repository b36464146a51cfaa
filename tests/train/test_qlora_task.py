"""QLoRA in the app (``+task.lora={..., quantize: int4}``): the folder's base is quantized,
then wrapped; a run's loss falls over a few steps; the checkpoint holds the adapters alone and
rebuilds the same model (the base re-read and quantized again: identical logits); the adapter
export loads in ``PeftModel.from_pretrained`` over the dequantized base and the merged export
(dequantized + merged) in ``transformers``, both within 1e-4 of the trained logits (fp32: the
packed kernels sum in their own order); ``make train EXP=llama_sft_qlora`` runs 3 steps and its
model summary shows the weights held; a quantized base without adapters is refused."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import transformers

from llmlab.models import save_pretrained
from llmlab.models.lora import lora_layers, lora_state_dict
from llmlab.models.quantize import QuantizedEmbedding, QuantizedLinear, dequantize
from llmlab.train.app import ConfigError, build_task, compose_config, validate_config
from llmlab.train.export import export
from llmlab.train.pretrained import resolve_init_from
from llmlab.train.sample import load_checkpoint
from tests.helpers.hf_tiny import build_hf
from tests.helpers.tiny import quiet_trainer, tiny_tokens

QLORA = ["+task.lora={r: 4, alpha: 8, target_modules: all-linear, quantize: int4}"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny HF Llama over the 256 bytes whose input widths (32, 64) int4's group divides."""
    from llmlab.tokenizer.hf_folder import HFTokenizerFiles
    from llmlab.train.data import ByteTokenizer

    path = tmp_path_factory.mktemp("init") / "tiny-llama"
    model = build_hf("Llama", dict(vocab_size=256, intermediate_size=64,
                                   max_position_embeddings=256))  # fmt: skip
    model.save_pretrained(path)
    HFTokenizerFiles(ByteTokenizer().as_bpe(), model_max_length=256).save_pretrained(path)
    return model, path


def _cfg(path, *extra):
    cfg = compose_config(["experiment=llama_finetune", f"model.init_from={path}", *QLORA, *extra])
    resolve_init_from(cfg)
    return cfg


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_a_qlora_run_trains_checkpoints_adapters_and_exports(folder, tmp_path):
    _, path = folder
    task = build_task(_cfg(path, "task.warmup_steps=0", "task.lr=1e-2"))
    losses = _Losses()
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[losses])
    trainer.fit(task, datamodule=tiny_tokens(1, vocab_size=256, seq=16))  # one batch, 6 times
    model = task.model.eval()
    assert len(lora_layers(model)) == 2 * 7
    assert all(isinstance(m.base_layer, QuantizedLinear) for m in lora_layers(model).values())
    assert any(isinstance(m, QuantizedEmbedding) for m in model.modules())
    assert losses.losses[-1] < losses.losses[0] - 0.05, losses.losses

    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    adapters = lora_state_dict(model)
    assert sorted(saved["state_dict"]) == sorted(f"model.{k}" for k in adapters)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(ids)
        again, _ = load_checkpoint(str(ckpt))  # folder re-read, quantized again, adapters on
        torch.testing.assert_close(again(ids), trained, atol=0, rtol=0)

    peft = pytest.importorskip("peft")
    out = export(ckpt, tmp_path / "adapter", adapter=True)
    base = copy.deepcopy(again)
    for name, layer in lora_layers(base).items():  # the adapters off: the quantized base alone
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent), child, layer.base_layer)
    save_pretrained(dequantize(base), tmp_path / "dequantized")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized")
    theirs = peft.PeftModel.from_pretrained(hf_base.eval(), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, trained, atol=1e-4, rtol=0)

    merged = export(ckpt, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, trained, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task.lora.quantize=int3"], r"lora\.quantize='int3' is not a scheme"),
        (["~task.lora", "+task.quantize=int4"], "quantize"),
    ],
)
def test_bad_quantized_bases_are_refused_before_any_work(folder, args, message):
    _, path = folder
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(path, *args), tokenizer_vocab=256)


@pytest.mark.distributed
def test_the_qlora_experiment_runs_three_steps_through_the_app(tmp_path):
    from tests.helpers.runs import run_train

    args = ["experiment=llama_sft_qlora", "trainer.max_steps=3", "trainer.val_check_interval=3",
            "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
            f"paths.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    result = run_train(args, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "QLoRA: base quantized to int4" in result.stdout + result.stderr
    assert "Weights held, quantized base (MB)" in result.stdout
    (ckpt,) = (tmp_path / "out" / "llama_sft_qlora").glob("*/checkpoints/last.ckpt")
    hp = torch.load(ckpt, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert hp["lora"]["quantize"] == "int4"


def test_a_compiled_qlora_run_equals_the_eager_one(folder):
    """Compiled blocks (``compile=true``'s transform) over the packed base: they call the
    quantized products as an opaque op (``llmlab::quantized_cpu_product``) and widen the weight
    in the backward; the losses of a few steps equal the eager run's."""
    from torch._dynamo.utils import counters

    from llmlab.parallel.compile import compile_blocks

    _, path = folder
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        torch._dynamo.reset()
        counters.clear()
        task = build_task(_cfg(path, "task.warmup_steps=0", "task.lr=1e-2"))
        if compiled:
            assert compile_blocks(task.model, backend="aot_eager") == 2  # both blocks
        losses = _Losses()
        trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[losses])
        trainer.fit(task, datamodule=tiny_tokens(1, vocab_size=256, seq=16))
        runs[compiled] = losses.losses
    assert not counters["graph_break"], dict(counters["graph_break"])  # whole blocks, op included
    assert len(runs[True]) == 3
    torch.testing.assert_close(runs[True], runs[False], atol=1e-5, rtol=0)
