"""Loading MODEL and the command line.

The main path is end to end: a ``CausalLMTask`` trains 2 steps and Lightning writes a real
checkpoint; ``python -m llmlab.serving`` serves it in a subprocess; the ``openai`` client's
greedy completion must equal ``llmlab.decoding.generate`` on the same checkpoint as
``llmlab.train.sample`` loads it (an independent reader). The other forms and every bad input
get a message naming what is wrong and what would work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from llmlab.decoding import generate
from llmlab.parallel.launch import free_port
from llmlab.serving.__main__ import main
from llmlab.serving.loading import load
from llmlab.tokenizer import BPETokenizer, ByteTokenizer, save
from tests.helpers.tiny import quiet_trainer, romeo_loader

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from llmlab.train.task import CausalLMTask

    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    loader = romeo_loader()
    task = CausalLMTask(model=SPEC, warmup_steps=1, max_steps=2,
                        tokenizer={"_target_": "llmlab.train.data.ByteTokenizer"})  # fmt: skip
    trainer = quiet_trainer(max_steps=2, default_root_dir=str(root), limit_val_batches=0)
    trainer.fit(task, train_dataloaders=loader)
    path = root / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("speculation", ["none", "int8 self-draft"])
def test_serving_a_training_checkpoint_from_the_command_line(checkpoint, speculation):
    """With ``--draft`` (the checkpoint as its own draft, in int8) the answer is the same."""
    from llmlab.train.sample import load_checkpoint

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "llmlab.serving", str(checkpoint), "--port", str(port),
           "--threads", "1", "--served-model-name", "romeo", "--log-level", "warning"]  # fmt: skip
    if speculation != "none":
        cmd += ["--draft", str(checkpoint), "--draft-quantize", "int8"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        answer = client.completions.create(model="romeo", prompt="ROMEO:", max_tokens=12,
                                           temperature=0)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    model, tok = load_checkpoint(str(checkpoint))
    ids = tok.encode("ROMEO:")
    expected = tok.decode(generate(model, torch.tensor([ids]), max_new_tokens=12)[0, 6:].tolist())
    assert answer.choices[0].text == expected


def test_load_rebuilds_the_model_and_the_byte_tokenizer(checkpoint):
    from llmlab.train.sample import load_checkpoint

    loaded = load(checkpoint)
    reference, _ = load_checkpoint(str(checkpoint))
    assert isinstance(loaded.tokenizer, ByteTokenizer) and loaded.name == "last"
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), reference(x), atol=0, rtol=0)


def test_an_exported_checkpoint_serves_as_an_hf_folder(checkpoint, tmp_path):
    """``make export`` (``llmlab.train.export``) writes the HF folder a sharded checkpoint must
    become; serving it gives the training checkpoint's model and tokenizer back."""
    from llmlab.train.export import export

    folder = export(str(checkpoint), tmp_path / "hf")
    loaded, direct = load(folder), load(checkpoint)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), direct.model(x), atol=0, rtol=0)
    assert loaded.tokenizer.encode("ROMEO: é") == direct.tokenizer.encode("ROMEO: é")
    assert loaded.name == "hf"


def test_a_trained_bpe_needs_its_file(tmp_path):
    ckpt = tmp_path / "bpe.ckpt"
    from llmlab.models import build_model

    model = build_model(SPEC)
    torch.save({"hyper_parameters": {"model": SPEC, "tokenizer": {
        "_target_": "llmlab.train.bpe_cache.load_or_train_bpe", "vocab_size": 256}},
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"'llmlab.train.bpe_cache.load_or_train_bpe'.*--tokenizer"
    ):
        load(ckpt)
    tok = BPETokenizer.train(["to be or not to be " * 20], vocab_size=260)
    loaded = load(ckpt, tokenizer=save(tok, tmp_path / "tok.json"))
    assert loaded.tokenizer.encode("to be") == tok.encode("to be")


def test_other_forms_are_refused_with_what_would_work(tmp_path):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"sharded \(DCP\) checkpoint folder.*make export CKPT="):
        load(tmp_path / "sharded")
    with pytest.raises(ValueError, match="neither a training checkpoint file"):
        load(tmp_path)
    torch.save({"w": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match=r"not an llmlab.train checkpoint.*hyper_parameters"):
        load(tmp_path / "plain.pt")


def test_an_hf_folder_goes_through_models_from_pretrained(tmp_path):
    """Model by ``llmlab.models.from_pretrained`` (logits as HF's, 1e-5), tokenizer from
    ``tokenizer.json``, chat template and eos from ``tokenizer_config.json``."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=None, eos_token_id=None)  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    tok = BPETokenizer.train(["abc abd " * 30], vocab_size=270, special_tokens=["<|endoftext|>"])
    save(tok, tmp_path / "tokenizer.json", format="hf")
    template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"})
    )
    loaded = load(tmp_path)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
    assert loaded.tokenizer.encode("abd abc") == tok.encode("abd abc")
    assert loaded.chat_template == template and loaded.eos_token_ids == [tok.eos_token_id]
    assert loaded.template_tokens["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["x.ckpt", "--max-num-seqs", "600"], "max_num_batched_tokens=512 must be >= max_num_seqs"),
        (["missing.ckpt"], "neither a training checkpoint file"),
        (["x.ckpt", "--block-size", "0"], "block_size must be a positive integer, got 0"),
        (
            ["x.ckpt", "--speculative", "ngram", "--num-speculative-tokens", "0"],
            "num_speculative_tokens must be a positive integer, got 0",
        ),
        (
            ["x.ckpt", "--speculative", "ngram", "--draft-quantize", "int8"],
            "draft_quantize='int8' needs speculative='draft'",
        ),
    ],
)
def test_the_cli_refuses_bad_settings_before_serving(argv, message, capsys, tmp_path):
    assert main([str(tmp_path / a) if a.endswith(".ckpt") else a for a in argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "--port 70000 is not a TCP port"),
        (["--speculative", "draft"], "--speculative draft needs --draft MODEL"),
        (["--speculative", "ngram", "--draft", "d.ckpt"], "--draft with --speculative ngram"),
    ],
)
def test_the_cli_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["x.ckpt", *argv])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("tokenizer_config.json", "{not json", "tokenizer_config.json: not valid JSON"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: expected a JSON object"),
        ("generation_config.json", '{"eos_token_id": 256,,}', "generation_config.json: not valid"),
        (
            "generation_config.json",
            '{"eos_token_id": 50256}',
            "generation_config.json: eos_token_id",
        ),
        ("generation_config.json", '{"eos_token_id": "eos"}', "is not an id of the model's vocab"),
    ],
)
def test_a_malformed_config_file_is_named_in_one_line(
    file, text, message, checkpoint, tmp_path, capsys
):
    """A damaged ``tokenizer_config.json`` / ``generation_config.json`` next to good weights:
    the CLI exits 2 with one line naming the file, never a traceback."""
    from llmlab.train.export import export

    folder = export(str(checkpoint), tmp_path / "hf")
    (folder / file).write_text(text)
    assert main([str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert str(folder / file) in err and message in err and err.count("\n") == 1


def _run_dir(checkpoint, root, experiment="romeo_exp"):
    """A training run directory as ``llmlab.train`` lays it out:
    ``<outputs>/<experiment>/<stamp>-<id>/`` with ``run_id``, the resolved ``config.yaml`` and
    ``checkpoints/last.ckpt``."""
    import shutil

    run = root / experiment / "20261206-120000-abcd1234"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_id").write_text("abcd1234\n")
    (run / "config.yaml").write_text(f"experiment: {experiment}\nseed: 1\n")
    shutil.copy(checkpoint, run / "checkpoints" / "last.ckpt")
    return run


def test_make_serve_takes_a_run_dir_and_names_the_model_after_the_experiment(
    checkpoint, tmp_path, capsys
):
    """``make serve CKPT=<run dir>`` (``python -m llmlab.train.serve``) resolves the run as
    ``make export`` / ``make eval`` do and serves it as its experiment, not as ``last``; the
    serving CLI itself, which may not import ``llmlab.train``, says where to go instead."""
    from llmlab.train.serve import main as train_serve
    from llmlab.train.serve import serving_argv

    run = _run_dir(checkpoint, tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    assert serving_argv([str(run), "--port", "0"]) == [
        str(last), "--served-model-name", "romeo_exp", "--port", "0",
    ]  # fmt: skip
    assert serving_argv([str(last)])[1:] == ["--served-model-name", "romeo_exp"]
    assert serving_argv([str(run), "--served-model-name", "x"]) == [
        str(last), "--served-model-name", "x",
    ]  # fmt: skip
    assert serving_argv([str(checkpoint)]) == [str(checkpoint)]  # outside a run: as before
    loaded = load(serving_argv([str(run)])[0])
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    # the hand-off reaches the serving CLI, which checks its options before loading anything
    assert train_serve([str(run), "--block-size", "0"]) == 2
    assert "block_size must be a positive integer" in capsys.readouterr().err
    assert train_serve([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope does not exist" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match=r"training run directory: serve it with `make serve"):
        load(run)
