"""``model.init_from=<folder>`` in the app: the model of a Hugging Face-format folder, its weights
and its tokenizer, in one process (the N-D layouts read slices: a later phase). The folder's
model gives ``transformers``' logits (within 1e-5) once the task has built it; bad folders end
in one ``error:`` line naming the file, from ``main`` before any process group or run dir."""

from __future__ import annotations

import json

import pytest
import torch

from llmlab.train.app import build_task, compose_config, main
from llmlab.train.pretrained import resolve_init_from
from tests.helpers.hf_tiny import byte_level_llama_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return byte_level_llama_folder(tmp_path_factory.mktemp("init") / "tiny-llama")


def test_the_task_starts_from_the_folders_weights_and_tokenizer(folder):
    hf, path = folder
    cfg = compose_config(["experiment=llama_finetune", f"model.init_from={path}"])
    spec = resolve_init_from(cfg)
    assert spec["arch"] == "llama" and cfg.model.n_kv_head == 2 and cfg.model.block_size == 256
    model = build_task(cfg).model.eval()
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)
    from llmlab.train.app import build_tokenizer

    tokenizer = build_tokenizer(cfg)
    assert tokenizer.encode("ROMEO: ô") == list("ROMEO: ô".encode())


def _error_line(args, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_OUTPUT_DIR", str(tmp_path / "outputs"))
    capsys.readouterr()  # what building the folders printed
    assert main(["experiment=llama_finetune", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert not (tmp_path / "outputs").exists()  # refused before any run dir
    return err


def test_bad_folders_fail_in_one_line_before_any_work(folder, tmp_path, capsys, monkeypatch):
    import shutil

    _, path = folder
    assert "model.init_from is required" in _error_line([], capsys, tmp_path, monkeypatch)

    sharded = tmp_path / "sharded"
    hf = folder[0]
    hf.save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(path / "tokenizer.json", sharded / "tokenizer.json")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = _error_line([f"model.init_from={sharded}"], capsys, tmp_path, monkeypatch)
    assert f"{shard.name}: missing" in err

    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-64])
    err = _error_line([f"model.init_from={truncated}"], capsys, tmp_path, monkeypatch)
    assert "model.safetensors: truncated" in err

    mismatched = tmp_path / "mismatched"
    shutil.copytree(path, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    err = _error_line([f"model.init_from={mismatched}"], capsys, tmp_path, monkeypatch)
    assert "config.json implies" in err and str(mismatched) in err

    args = [f"model.init_from={path}", "+model.n_layer=3"]  # Hydra refuses it without "+"
    err = _error_line(args, capsys, tmp_path, monkeypatch)
    assert "model.n_layer=3" in err and "only block_size, dropout, kernels" in err
