"""``task.lora`` in the app (llmlab.train.adapters): adapters on the folder's model after it is
read, only they in the optimizer and in the checkpoint, the checkpoint resumed and exported
(merged for ``transformers``, or as a peft folder for ``PeftModel.from_pretrained``), logits
within 1e-5 of the trained model (fp32); layouts that do not carry adapters refused (the ones
that do: tests/integration/test_lora_layouts.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from llmlab.models.lora import LoRALinear, disable_lora, lora_layers, lora_state_dict
from llmlab.train.app import ConfigError, build_task, compose_config, validate_config
from llmlab.train.export import export
from llmlab.train.pretrained import resolve_init_from
from llmlab.train.sample import load_checkpoint
from tests.helpers.hf_tiny import byte_level_llama_folder
from tests.helpers.tiny import quiet_trainer, tiny_task, tiny_tokens

LORA = ["+task.lora={r: 4, alpha: 8, target_modules: all-linear}"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return byte_level_llama_folder(tmp_path_factory.mktemp("init") / "tiny-llama")


def _cfg(path, *extra):
    cfg = compose_config(["experiment=llama_finetune", f"model.init_from={path}", *LORA, *extra])
    resolve_init_from(cfg)
    return cfg


def _fit(task, steps, vocab=256):
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0)
    trainer.fit(task, datamodule=tiny_tokens(4, vocab_size=vocab, seq=16))
    return trainer


def test_adapters_train_alone_and_the_checkpoint_holds_only_them(folder, tmp_path):
    hf, path = folder
    task = build_task(_cfg(path, "task.warmup_steps=0", "task.lr=1e-2"))
    trainer = _fit(task, 3)
    model = task.model.eval()
    assert len(lora_layers(model)) == 2 * 7
    adapters = lora_state_dict(model)
    in_optimizer = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in adapters.values()}
    assert not any(p.requires_grad for p in model.parameters() if id(p) not in in_optimizer)
    assert any(layer.lora_B.weight.abs().max() > 0 for layer in lora_layers(model).values())

    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert sorted(saved["state_dict"]) == sorted(f"model.{k}" for k in adapters)
    assert saved["hyper_parameters"]["lora"]["r"] == 4

    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(ids)
        again, _ = load_checkpoint(str(ckpt))  # base re-read from the folder, adapters on it
        torch.testing.assert_close(again(ids), trained, atol=0, rtol=0)
        with disable_lora(model):  # the base alone is still the folder's model, untouched
            torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)

    merged = export(ckpt, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, trained, atol=1e-5, rtol=0)

    peft = pytest.importorskip("peft")
    out = export(ckpt, tmp_path / "adapter", adapter=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, trained, atol=1e-5, rtol=0)

    # resume: a fresh task reads the folder, Lightning restores the adapters from the checkpoint
    resumed = build_task(_cfg(path))
    quiet_trainer(limit_val_batches=1).validate(
        resumed, datamodule=tiny_tokens(1, vocab_size=256, seq=16), ckpt_path=ckpt, verbose=False
    )
    for key, tensor in lora_state_dict(resumed.model).items():
        assert torch.equal(tensor, adapters[key]), key


def test_from_a_random_base_the_checkpoint_holds_the_whole_model(tmp_path):
    spec = dict(arch="gpt", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    task = tiny_task(model=spec, lora={"r": 2, "alpha": 4, "target_modules": "attention"})
    trainer = _fit(task, 2, vocab=64)
    assert isinstance(task.model.blocks[0].attn.qkv, LoRALinear)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert "model.blocks.0.attn.qkv.base_layer.weight" in saved  # no folder to re-read it from
    again, _ = load_checkpoint(str(ckpt))
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), task.model.eval()(ids), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["strategy=deepspeed", "trainer.devices=2"],
            "adapters run under one process, Lightning's DDP, or llmlab's N-D strategy",
        ),
        (
            ["strategy=tensor", "trainer.devices=2", "+task.lora.quantize=int8"],
            r"task.lora with lora.quantize=int8 \(QLoRA quantizes the whole base in one",
        ),
        (
            ["strategy=tensor", "trainer.devices=2", "+task.lora.dropout=0.1"],
            r"lora.dropout=0.1 with strategy.tensor=2",
        ),
        (["task.lora.r=0"], r"lora\.r must be a positive integer"),
        (["+task.lora.rank=4"], "unexpected keyword argument 'rank'"),
    ],
)
def test_bad_lora_configs_are_refused_before_any_work(folder, args, message):
    _, path = folder
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(path, *args), tokenizer_vocab=256)
