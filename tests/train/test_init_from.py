"""``model.init_from=<folder>`` in the app: the model of a Hugging Face-format folder, its weights
and its tokenizer. The folder's model gives ``transformers``' logits (within 1e-5) once the task
has read it (``configure_model``, whole; the N-D layouts read slices:
``tests/parallel/test_init_from_layouts.py``); ``make train EXP=llama_finetune`` in a 2×2×2 layout
starts from the same loss as one process, and with DeepSpeed ZeRO-3 as DDP (slow); bad folders
end in one ``error:`` line naming the file, from ``main`` before any process group or run dir,
whatever the layout."""

from __future__ import annotations

import json

import pytest
import torch

from llmlab.train.app import build_task, compose_config, main
from llmlab.train.pretrained import resolve_init_from
from tests.helpers.hf_tiny import byte_level_llama_folder
from tests.helpers.runs import run_train, wandb_history


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return byte_level_llama_folder(tmp_path_factory.mktemp("init") / "tiny-llama")


def test_the_task_starts_from_the_folders_weights_and_tokenizer(folder):
    hf, path = folder
    cfg = compose_config(["experiment=llama_finetune", f"model.init_from={path}"])
    spec = resolve_init_from(cfg)
    assert spec["arch"] == "llama" and cfg.model.n_kv_head == 2 and cfg.model.block_size == 256
    task = build_task(cfg)
    assert next(task.model.parameters()).is_meta  # read once the layout is known
    task.configure_model()  # no strategy took the weights: the whole model is read
    model = task.model.eval()
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
    # The same in a 2x2x2 layout: refused by the one process of `make train`, before Lightning
    # launches the other seven or any process group starts.
    args = [f"model.init_from={truncated}", *ND_2X2X2]
    assert "model.safetensors: truncated" in _error_line(args, capsys, tmp_path, monkeypatch)

    mismatched = tmp_path / "mismatched"
    shutil.copytree(path, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    err = _error_line([f"model.init_from={mismatched}"], capsys, tmp_path, monkeypatch)
    assert "config.json implies" in err and str(mismatched) in err

    sentencepiece = tmp_path / "sentencepiece"
    shutil.copytree(path, sentencepiece)
    _sentencepiece_tokenizer(sentencepiece / "tokenizer.json")
    err = _error_line([f"model.init_from={sentencepiece}"], capsys, tmp_path, monkeypatch)
    assert "normalizer 'Nmt'" in err, err  # the loader's own reason, then what the file is
    assert "tokenizer.json is a SentencePiece-style BPE tokenizer" in err, err

    args = [f"model.init_from={path}", "+model.n_layer=3"]  # Hydra refuses it without "+"
    err = _error_line(args, capsys, tmp_path, monkeypatch)
    assert "model.n_layer=3" in err and "only block_size, dropout, kernels" in err


def _sentencepiece_tokenizer(path):
    """A Llama-2-style tokenizer.json, written by HF ``tokenizers`` (BPE over '▁'-marked text with
    byte fallback), with sentencepiece's ``Nmt`` normalizer, which llmlab.tokenizer refuses."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "▁a": 5}
    bpe = models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    steps = [normalizers.Nmt(), normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    tok.save(str(path))


ND_2X2X2 = ["strategy=nd", "strategy.pipeline=2", "strategy.tensor=2", "trainer.devices=8"]
DDP_2 = ["strategy=ddp", "trainer.devices=2"]
DEEPSPEED_3 = ["strategy=deepspeed", "strategy.stage=3"]


@pytest.mark.slow
@pytest.mark.distributed
def test_make_train_2x2x2_and_deepspeed_start_from_the_single_process_loss(folder, tmp_path):
    _, path = folder
    args = ["experiment=llama_finetune", f"model.init_from={path}", "trainer.max_steps=1",
            "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false"]  # fmt: skip
    args.append(f"paths.cache_dir={tmp_path / 'cache'}")
    losses = {}
    runs = (("one", []), ("nd", ND_2X2X2), ("ddp", DDP_2), ("deepspeed", [*DDP_2, *DEEPSPEED_3]))
    for name, layout in runs:
        result = run_train([*args, *layout], tmp_path / name, timeout=1200)
        assert result.returncode == 0, result.stderr[-4000:]
        (run,) = (tmp_path / name / "llama_finetune").glob("*/wandb/offline-run-*")
        (losses[name],) = [h["train/loss"] for h in wandb_history(run) if "train/loss" in h]
        if name == "nd":  # every rank's read and memory, logged once by rank 0
            for rank in range(8):
                assert f"init_from: rank {rank} at Coords(" in result.stdout, result.stdout[-3000:]
    assert abs(losses["nd"] - losses["one"]) <= 1e-5, losses  # fp32, same global batch
    # DeepSpeed: every rank reads the whole model (configure_model), ZeRO-3 partitions it. Rank 0
    # logs the loss of its own half of the batch, so the oracle is DDP on the same two ranks.
    assert abs(losses["deepspeed"] - losses["ddp"]) <= 1e-5, losses
