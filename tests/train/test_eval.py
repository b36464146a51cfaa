"""``make eval``: lm-evaluation-harness on llmlab models through ``LlmlabLM``.

Oracles: a direct computation of the held-out text's bits per byte with a plain forward and
``F.cross_entropy`` (within 1e-4), and lm-eval's own ``hf`` model type on the exported folder
(``transformers`` running the same weights): log-likelihoods within 1e-4, the same greedy flags,
accuracy and generated text identical. One trained tiny GPT and one lm-eval import serve all.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runs import wandb_history
from tests.helpers.tiny import quiet_trainer, tiny_task, tiny_tokens

BYTES = {"_target_": "llmlab.train.data.ByteTokenizer"}
GPT = dict(arch="gpt", vocab_size=256, block_size=96, n_layer=2, n_head=2, n_embd=32)
MAX_CHARS = 400  # of each held-out work: 5 documents of ~5 windows each


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny byte-level GPT after 3 real optimizer steps, its .ckpt and its HF export."""
    from llmlab.train.export import export
    from llmlab.train.sample import load_checkpoint

    root = tmp_path_factory.mktemp("eval")
    task = tiny_task(model=GPT, tokenizer=BYTES, max_steps=3)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0)
    trainer.fit(task, datamodule=tiny_tokens(3, vocab_size=256, seq=32))
    trainer.save_checkpoint(root / "last.ckpt")
    model, tokenizer = load_checkpoint(str(root / "last.ckpt"))
    return model, tokenizer, root / "last.ckpt", export(root / "last.ckpt", root / "hf")


@pytest.fixture(scope="module")
def lms(trained):
    from lm_eval.models.huggingface import HFLM

    from llmlab.train.evaluation.lm import LlmlabLM

    model, tokenizer, _, folder = trained
    ours = LlmlabLM(model, tokenizer, batch_size=8)
    assert ours.prefix_token_id == 10  # bytes have no EOS/BOS: a newline starts a document
    theirs = HFLM(pretrained=str(folder), batch_size=8, device="cpu")
    theirs.custom_prefix_token_id = 10  # the exported byte tokenizer has no EOS/BOS either
    return ours, theirs


def _requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _direct_bits_per_byte(model, texts, block):
    """-Σ log p / (ln 2 · bytes), windows as lm-eval's: the first token after a "\\n" prefix,
    then disjoint chunks of ``block`` tokens each conditioned on the token before it (the
    last chunk on a full window before it)."""
    nll, size = 0.0, 0
    for text in texts:
        ids = list(text.encode("utf-8"))
        tokens = [10, *ids]  # tokens[j + 1] = ids[j] is predicted from tokens[: j + 1]
        size += len(ids)
        for start in range(0, len(ids), block):
            end = min(start + block, len(ids))  # predict ids[start:end] ...
            inputs = tokens[max(0, end - block) : end]  # ... from a full window (the last too)
            with torch.no_grad():
                logits = model(torch.tensor([inputs]))[0, -(end - start) :]
            nll += F.cross_entropy(
                logits.double(), torch.tensor(ids[start:end]), reduction="sum"
            ).item()
    return nll / math.log(2) / size


def test_the_perplexity_task_equals_a_direct_computation(trained):
    from llmlab.train.evaluation.run import evaluate
    from llmlab.train.evaluation.tasks.shakespeare import held_out_works

    model, tokenizer, _, _ = trained
    results = evaluate(model, tokenizer, ["shakespeare_bpb"], metadata={"max_chars": MAX_CHARS})
    got = results["results"]["shakespeare_bpb"]["bits_per_byte,none"]
    texts = held_out_works(MAX_CHARS)["validation"]["text"]
    expected = _direct_bits_per_byte(model, texts, model.config.block_size)
    assert abs(got - expected) < 1e-4, (got, expected)


def test_lm_eval_hf_on_the_export_gives_the_same_numbers(lms, trained):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llmlab.train.evaluation.run import TASKS_DIR
    from llmlab.train.evaluation.tasks.shakespeare import cloze

    ours, theirs = lms
    docs = cloze()["validation"].select(range(6))
    args = [(d["context"], c) for d in docs for c in d["choices"]] + [("", "ROMEO:")]
    mine, hf = (lm.loglikelihood(_requests("loglikelihood", args)) for lm in (ours, theirs))
    for (a, greedy_a), (b, greedy_b) in zip(mine, hf):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b, (a, b)
    texts = [("Now is the winter of our discontent\nMade glorious summer " * 3,)]
    rolled = [lm.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)) for lm in lms]
    assert abs(rolled[0][0] - rolled[1][0]) < 1e-4
    # generate_until against transformers' greedy generate on the export, cut at the stop
    # string (lm-eval's hf type itself needs an EOS token to generate, which bytes do not have).
    prompts = [("ROMEO:", {"until": ["\n"], "max_gen_toks": 12}), ("JULIET:\nO", {"until": ["e"]})]
    generated = ours.generate_until(_requests("generate_until", prompts))
    hf = theirs.model
    hf.generation_config.eos_token_id = None
    for (prompt, settings), text in zip(prompts, generated):
        ids = torch.tensor([list(prompt.encode())])
        new = settings.get("max_gen_toks", ours.max_gen_toks)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          do_sample=False)[0, ids.shape[1] :]  # fmt: skip
        expected = bytes(out.tolist()).decode("utf-8", errors="replace")
        assert text == expected.split(settings["until"][0])[0]

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    scores = [
        lm_eval.simple_evaluate(
            model=lm, tasks=["shakespeare_cloze"], limit=10, task_manager=manager, bootstrap_iters=0
        )
        for lm in (ours, theirs)
    ]
    a, b = (s["results"]["shakespeare_cloze"] for s in scores)
    assert (a["acc,none"], a["acc_norm,none"]) == (b["acc,none"], b["acc_norm,none"])


def test_make_eval_prints_the_table_writes_json_and_resumes_the_wandb_run(
    trained, tmp_path, capsys, monkeypatch
):
    from llmlab.train.eval import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(trained[2], run / "checkpoints" / "last.ckpt")
    (run / "run_id").write_text("evalrun1\n")
    (run / "config.yaml").write_text(
        "logger:\n  project: llmlab\n  entity: null\n  mode: offline\n"
    )
    args = [str(run), "--tasks", "shakespeare_bpb,shakespeare_cloze", "--limit", "8"]
    assert main([*args, "--max-chars", "300"]) == 0
    out = capsys.readouterr().out
    assert "shakespeare_bpb" in out and "bits_per_byte" in out and "acc" in out
    saved = json.loads((run / "eval" / "last-eval.json").read_text())
    assert "eval/shakespeare_bpb/bits_per_byte" in saved["metrics"], saved
    bpb = saved["metrics"]["eval/shakespeare_bpb/bits_per_byte"]
    (wandb_dir,) = (run / "wandb").glob("offline-run-*-evalrun1")
    (logged,) = wandb_history(wandb_dir)  # the W&B run of the training run, by its id
    assert logged["eval/shakespeare_bpb/bits_per_byte"] == pytest.approx(bpb)
    assert main([str(run), "--tasks", "hellaswagg"]) == 2
    assert "unknown eval task(s) ['hellaswagg']" in capsys.readouterr().err


def test_an_experiment_can_evaluate_at_the_end_of_training(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from llmlab.train.evaluation.callback import EvalAfterTraining

    with pytest.raises(ValueError, match="unknown eval task"):
        EvalAfterTraining(tasks=["nope"])
    callback = EvalAfterTraining(tasks=["shakespeare_cloze"], limit=4)
    task = tiny_task(model=GPT, tokenizer=BYTES, max_steps=1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer = quiet_trainer(
        max_steps=1,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        enable_checkpointing=True,
        callbacks=[checkpoints, callback],
    )
    trainer.fit(task, datamodule=tiny_tokens(1, vocab_size=256, seq=32))
    assert 0.0 <= callback.metrics["eval/shakespeare_cloze/acc"] <= 1.0
    assert (tmp_path / "eval" / "last.json").exists()


def test_callbacks_eval_composes_with_any_experiment():
    from llmlab.train.app import build, compose_config

    cfg = compose_config(["experiment=llama_shakespeare", "callbacks=eval",
                          "callbacks.eval.tasks=[shakespeare_cloze]"])  # fmt: skip
    callback = build(cfg.callbacks.eval, "callback eval")
    assert callback.tasks == ["shakespeare_cloze"]
