"""``python -m llmlab.train.export``: training checkpoints (a consolidated Lightning ``.ckpt``, a
sharded N-D checkpoint folder, a run directory) to HF folders that ``transformers`` loads with
no custom code: ``AutoModelForCausalLM`` logits within 1e-5 of the trained model and the same
greedy tokens; ``AutoTokenizer`` encodes and decodes as the training tokenizer did."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from llmlab.decoding import generate
from llmlab.models import from_pretrained
from llmlab.train.export import check_out_dir, checkpoint_path, export, main, parse_size
from tests.helpers.tiny import quiet_trainer, tiny_task, tiny_tokens

BYTES = {"_target_": "llmlab.train.data.ByteTokenizer"}
GPT = dict(arch="gpt", vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
LLAMA = dict(arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
             n_embd=32, intermediate_size=48, tie_embeddings=True)  # fmt: skip
TEXT = "ROMEO: But soft, what light through yonder window breaks? Ünïcödé ✓"


def _trained(model, tmp_path, name, strategy="auto", tokenizer=BYTES):
    """Two real optimizer steps of ``CausalLMTask`` and the checkpoint Lightning writes."""
    task = tiny_task(model=model, tokenizer=tokenizer, max_steps=2)
    trainer = quiet_trainer(max_steps=2, strategy=strategy, limit_val_batches=0)
    vocab = model["vocab_size"]
    trainer.fit(task, datamodule=tiny_tokens(2, vocab_size=vocab, seq=16))
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return task.model.eval(), path


def _check_transformers_loads(model, out):
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([list(TEXT.encode())[:30]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=0)
    # the byte tokenizer has no bos/eos/pad: written as null, not transformers' class defaults
    # (GPT-2's 50256 lies outside the 256-token vocabulary; Llama's 1 and 2 are bytes)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (None,) * 3
    assert hf.generation_config.eos_token_id is None
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


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_eos_and_pad_ids_lie_in_the_vocabulary(arch, tmp_path, caplog):
    """A tokenizer with an end-of-text token (and no bos or pad): its id is eos in config.json
    and eos and pad in generation_config.json, ``<|endoftext|>`` in tokenizer_config.json, and
    ``generate`` on a left-padded batch stays inside the 257-token vocabulary."""
    spec = {**(GPT if arch == "gpt" else LLAMA), "vocab_size": 257}
    eos_bytes = {"_target_": "llmlab.tokenizer.ByteTokenizer", "eos": True}
    _, ckpt = _trained(spec, tmp_path, "last.ckpt", tokenizer=eos_bytes)
    out = export(ckpt, tmp_path / "hf")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": None, "eos_token_id": 256, "pad_token_id": 256}
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        None, 256, None,
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        tok = transformers.AutoTokenizer.from_pretrained(out)
    assert "within the vocabulary" not in caplog.text
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 256)
    assert hf.generation_config.eos_token_id == 256 and hf.generation_config.pad_token_id == 256
    ids = torch.tensor([[256, 256, 72, 105], [82, 79, 77, 69]])  # row 0 left-padded
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    new = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)[:, 4:]
    assert int(new.max()) < 257 and int(new.min()) >= 0
    for row in new.tolist():  # once eos is generated, only padding (= eos) follows
        if 256 in row:
            assert set(row[row.index(256) :]) == {256}


def test_a_chat_tokenizer_leaves_with_its_own_special_tokens(tmp_path):
    """A run on the chat example's tokenizer (its ``tokenizer_config.json``: eos ``<|im_end|>``,
    pad ``<|endoftext|>``, a ChatML template): the export carries the template and those roles,
    and the ids in ``config.json`` / ``generation_config.json`` follow them, so the exported
    chat model stops at the end of its turn (the export alone guessed eos = ``<|endoftext|>``
    from its spelling)."""
    from llmlab.train.chat import EXAMPLE_DIR

    chat = {"_target_": "llmlab.tokenizer.load", "path": str(EXAMPLE_DIR / "tokenizer.json")}
    _, ckpt = _trained({**LLAMA, "vocab_size": 384}, tmp_path, "last.ckpt", tokenizer=chat)
    out = export(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 0)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (2, 0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    example = transformers.AutoTokenizer.from_pretrained(EXAMPLE_DIR)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>", 2, "<|endoftext|>", 0,
    )  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(messages, tokenize=False) == example.apply_chat_template(
        messages, tokenize=False
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.generation_config.eos_token_id == 2


def test_out_dir_must_be_a_new_or_empty_folder(tmp_path, capsys):
    """An existing file or a folder holding files is refused in one line, before the checkpoint
    is read (the checkpoint here does not even exist); ``--overwrite`` allows the folder."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main([str(tmp_path / "nope.ckpt"), str(afile)]) == 2
    err = capsys.readouterr().err
    assert "afile" in err and "existing file" in err and err.count("\n") == 1
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    assert main([str(tmp_path / "nope.ckpt"), str(full)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err and "notes.txt" in err
    assert err.count("\n") == 1
    assert check_out_dir(full, overwrite=True) == full
    assert check_out_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_out_dir(tmp_path / "empty") == tmp_path / "empty"
    _, ckpt = _trained(GPT, tmp_path, "last.ckpt")
    assert main([str(ckpt), str(full), "--overwrite"]) == 0
    assert (full / "notes.txt").read_text() == "keep me" and (full / "config.json").is_file()
