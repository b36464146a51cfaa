"""``python -m llmlab.train.export``: training checkpoints (a consolidated Lightning ``.ckpt``, a
sharded N-D checkpoint folder, a run directory) to HF folders that ``transformers`` loads with
no custom code: ``AutoModelForCausalLM`` logits within 1e-5 of the trained model and the same
greedy tokens; ``AutoTokenizer`` encodes and decodes as the training tokenizer did."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from llmlab.decoding import generate
from llmlab.models import from_pretrained
from llmlab.train.export import checkpoint_path, export, main, parse_size
from tests.helpers.tiny import quiet_trainer, tiny_task, tiny_tokens

BYTES = {"_target_": "llmlab.train.data.ByteTokenizer"}
GPT = dict(arch="gpt", vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
LLAMA = dict(arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
             n_embd=32, intermediate_size=48, tie_embeddings=True)  # fmt: skip
TEXT = "ROMEO: But soft, what light through yonder window breaks? Ünïcödé ✓"


def _trained(model, tmp_path, name, strategy="auto"):
    """Two real optimizer steps of ``CausalLMTask`` and the checkpoint Lightning writes."""
    task = tiny_task(model=model, tokenizer=BYTES, max_steps=2)
    trainer = quiet_trainer(max_steps=2, strategy=strategy, limit_val_batches=0)
    trainer.fit(task, datamodule=tiny_tokens(2, vocab_size=256, seq=16))
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return task.model.eval(), path


def _check_transformers_loads(model, out):
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([list(TEXT.encode())[:30]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=0)
    hf.generation_config.eos_token_id = None
    theirs = hf.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]),
                         max_new_tokens=8, do_sample=False)  # fmt: skip
    assert torch.equal(theirs, generate(model, ids[:, :8], max_new_tokens=8))
    assert tok(TEXT)["input_ids"] == list(TEXT.encode("utf-8"))  # the byte tokenizer's ids
    assert tok.decode(list(TEXT.encode("utf-8"))) == TEXT


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama-tied"])
def test_a_consolidated_checkpoint_exports_for_transformers(spec, tmp_path):
    model, ckpt = _trained(spec, tmp_path, "last.ckpt")
    out = export(ckpt, tmp_path / "hf")
    _check_transformers_loads(model, out)
    again = from_pretrained(out)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k  # bit-exact


def test_a_sharded_checkpoint_and_a_run_dir_export_alike(tmp_path):
    from llmlab.parallel.checkpoint import is_sharded
    from llmlab.parallel.strategy import NDParallelStrategy

    model, ckpt = _trained(
        LLAMA, tmp_path, "last.ckpt", NDParallelStrategy(sharded_checkpoints=True)
    )
    assert is_sharded(ckpt)
    out = export(ckpt, tmp_path / "hf", max_shard_size=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    _check_transformers_loads(model, out)
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "last.ckpt")
    assert checkpoint_path(run) == run / "checkpoints" / "last.ckpt"
    assert main([str(run), str(tmp_path / "hf2")]) == 0
    a, b = from_pretrained(out), from_pretrained(tmp_path / "hf2")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nope.ckpt does not exist" in err and err.count("\n") == 1
    assert parse_size("30KB") == 30_000 and parse_size("5GB") == 5 * 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
