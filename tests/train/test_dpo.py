"""``task=dpo`` (llmlab.train.dpo) on ``data=preference`` (llmlab.train.preference).

* The pairs are tokenized as TRL's ``DPOTrainer`` tokenizes them (prompt / chosen / rejected
  ids equal, chat and string formats).
* The loss and the logged rewards, margins and accuracy equal TRL's ``DPOTrainer._compute_loss``
  (sigmoid, same β) on the same logits, within 1e-6 (fp32). TRL's method runs unchanged; only
  the trainer around it (accelerator, metric store) and the model (which returns the per-token
  log-probabilities of the same logits) are stand-ins.
* Through Lightning: with LoRA the reference is the adapters-off model (the first step's loss is
  log 2, policy == reference) and only adapters train; without adapters every pair's reference
  is computed once, before the first step, and kept in the checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmlab.parallel.loss_mean import IGNORE_INDEX
from llmlab.tokenizer import load
from llmlab.train.app import ConfigError, compose_config, validate_config
from llmlab.train.chat import EXAMPLE_DIR
from llmlab.train.dpo import DPOTask, dpo_loss, pair_metrics, sequence_logps
from llmlab.train.preference import PreferenceDataModule
from tests.helpers.tiny import quiet_trainer

PAIRS = EXAMPLE_DIR / "preferences.jsonl"
TINY_LLAMA = dict(arch="llama", vocab_size=384, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                  n_embd=32, intermediate_size=64)  # fmt: skip
STRING_PAIRS = [
    {"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Colour of the sky:", "chosen": " blue<|im_end|>", "rejected": " green, maybe"},
    {"prompt": "Say hi", "chosen": " hi", "rejected": " bye"},
    {"prompt": "Count: 1 2", "chosen": " 3", "rejected": " 7 8 9"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load(EXAMPLE_DIR / "tokenizer.json")


def _data(tokenizer, tmp_path, files=PAIRS, **kw):
    kw = {"block_size": 64, "batch_size": 4, "val_fraction": 0.2, **kw}
    return PreferenceDataModule(str(files), tokenizer, template=str(EXAMPLE_DIR),
                                cache_dir=str(tmp_path / "cache"), **kw)  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "string"])
def test_pairs_tokenize_as_trl_dpo_trainer(tokenizer, tmp_path, kind):
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    if kind == "chat":
        records = [json.loads(line) for line in PAIRS.read_text().splitlines()]
        files = PAIRS
    else:
        records = STRING_PAIRS
        files = tmp_path / "pairs.jsonl"
        files.write_text("".join(json.dumps(r) + "\n" for r in records))
    hf_tok = transformers.AutoTokenizer.from_pretrained(EXAMPLE_DIR)
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                         max_length=None)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    trainer = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, processing_class=hf_tok,
        train_dataset=datasets.Dataset.from_list(records),
    )  # fmt: skip
    data = _data(tokenizer, tmp_path, files, val_files=str(files), val_fraction=0.0, batch_size=1)
    ci, ct, ri, rt = data.splits["train"]
    for i, row in enumerate(trainer.train_dataset):
        for inputs, targets, completion in ((ci[i], ct[i], row["chosen_ids"]),
                                            (ri[i], rt[i], row["rejected_ids"])):  # fmt: skip
            ids = row["prompt_ids"] + completion
            assert inputs[: len(ids) - 1].tolist() == ids[:-1]
            expected = [IGNORE_INDEX] * (len(row["prompt_ids"]) - 1) + completion
            assert targets[: len(ids) - 1].tolist() == expected
            assert (targets[len(ids) - 1 :] == IGNORE_INDEX).all()


def _trl_compute_loss(beta, logits, targets, ref_chosen, ref_rejected):
    """TRL's own ``DPOTrainer._compute_loss`` on rows whose per-token log-probabilities are
    those of ``logits`` (TRL's labels: the token itself where the completion mask is 1)."""
    from trl import DPOTrainer

    n, T = targets.shape
    input_ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), targets.clamp(min=0)], dim=1)
    completion_mask = torch.cat(
        [torch.zeros(n, 1, dtype=torch.long), (targets != IGNORE_INDEX).long()], dim=1
    )
    token_logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    token_logps = token_logps * (targets != IGNORE_INDEX)

    def model(**kwargs):
        assert torch.equal(kwargs["labels"][:, 1:].clamp(min=-100), torch.where(
            completion_mask[:, 1:].bool(), input_ids[:, 1:], IGNORE_INDEX))  # fmt: skip
        zeros = torch.zeros(n, T)
        return SimpleNamespace(log_probs=token_logps, entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool())  # fmt: skip

    identity = lambda x: x  # noqa: E731
    metrics = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather=identity, gather_for_metrics=identity),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=beta,
        use_weighting=False, label_smoothing=0.0, _metrics=metrics, _total_train_tokens=0,
        _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
        "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }  # fmt: skip
    loss = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_and_rewards_equal_trl(beta):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    b, T, V = 6, 12, 50
    logits = torch.randn(2 * b, T, V, generator=g) * 3
    targets = torch.randint(0, V, (2 * b, T), generator=g)
    targets[:, : T // 3] = IGNORE_INDEX  # the prompt
    targets[::3, -2:] = IGNORE_INDEX  # padding
    ref = sequence_logps(logits + torch.randn(2 * b, T, V, generator=g), targets)
    ref_chosen, ref_rejected = ref.chunk(2)

    chosen, rejected = sequence_logps(logits, targets).chunk(2)
    losses, r_c, r_r = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
    ours = {k: float(v.mean()) for k, v in pair_metrics(r_c, r_r).items()}
    trl_loss, trl = _trl_compute_loss(beta, logits, targets, ref_chosen, ref_rejected)

    assert abs(float(losses.mean()) - float(trl_loss)) < 1e-6
    names = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
             "margins": "rewards/margins", "accuracy": "rewards/accuracies"}  # fmt: skip
    for ours_name, trl_name in names.items():
        assert abs(ours[ours_name] - trl[trl_name]) < 1e-6, ours_name
    assert abs(float(chosen.mean()) - trl["logps/chosen"]) < 1e-5
    assert 0 < ours["accuracy"] < 1  # both outcomes occur: the comparison means something


def test_dpo_loss_on_known_numbers():
    """The paper's formula by hand: margins 0 give log 2; β(Δc - Δr) = 1 gives log(1 + e^-1)."""
    zero = torch.zeros(1)
    losses, r_c, r_r = dpo_loss(zero, zero, zero, zero, beta=0.1)
    assert math.isclose(float(losses), math.log(2), rel_tol=1e-7)
    losses, r_c, r_r = dpo_loss(torch.tensor([-2.0]), torch.tensor([-9.0]), torch.tensor([-4.0]),
                                torch.tensor([-1.0]), beta=0.1)  # fmt: skip
    # Δc = 2, Δr = -8: β(Δc - Δr) = 1
    assert math.isclose(float(losses), math.log(1 + math.exp(-1)), rel_tol=1e-6)
    assert math.isclose(float(r_c), 0.2, rel_tol=1e-6)
    assert math.isclose(float(r_r), -0.8, rel_tol=1e-6)


def _task(**kw):
    torch.manual_seed(0)
    return DPOTask(model=TINY_LLAMA, lr=1e-2, warmup_steps=0, max_steps=3, **kw)


def test_with_lora_the_reference_is_the_adapters_off_model(tokenizer, tmp_path):
    from llmlab.models.lora import lora_state_dict

    data = _data(tokenizer, tmp_path)
    task = _task(lora={"r": 4, "alpha": 8, "target_modules": "all-linear"})
    assert task.reference == "adapters"
    task.configure_model()
    batch = data.collate([data.split_dataset("train")[i] for i in range(4)])
    losses, _ = task.pair_losses("train", batch)  # B = 0: policy == reference
    torch.testing.assert_close(losses, torch.full((4,), math.log(2)), atol=1e-6, rtol=0)
    base = {k: v.clone() for k, v in task.model.state_dict().items() if "lora" not in k}

    trainer = quiet_trainer(max_steps=3, limit_val_batches=1, val_check_interval=3)
    trainer.fit(task, datamodule=data)
    logged = trainer.callback_metrics
    for name in ("rewards_chosen", "rewards_rejected", "margins", "accuracy"):
        assert f"dpo/{name}" in logged and f"val/dpo/{name}" in logged
    assert float(logged["dpo/margins"]) == pytest.approx(
        float(logged["dpo/rewards_chosen"] - logged["dpo/rewards_rejected"]), abs=1e-6
    )
    after = task.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base never moves
    assert any(v.abs().max() > 0 for k, v in lora_state_dict(task.model).items() if "B" in k)
    # the reference is still the base: with the adapters off, the logits are the base's
    inputs, targets, _ = batch
    reference = task.logps(inputs, targets, reference=True)
    fresh = _task(lora={"r": 4, "alpha": 8, "target_modules": "all-linear"})
    fresh.configure_model()  # adapters at their start (B = 0): the model is its base
    missing, unexpected = fresh.model.load_state_dict(base, strict=False)
    assert not unexpected and all("lora" in k for k in missing)
    torch.testing.assert_close(reference, fresh.logps(inputs, targets).detach(), atol=1e-5, rtol=0)


def test_without_adapters_the_reference_is_computed_once_and_checkpointed(tokenizer, tmp_path):
    data = _data(tokenizer, tmp_path)
    task = _task()
    assert task.reference == "precomputed"
    initial = copy.deepcopy(task.model)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(task, datamodule=data)
    for split in ("train", "validation"):
        dataset = data.split_dataset(split)
        inputs, targets, _ = data.collate([dataset[i] for i in range(len(dataset))])
        with torch.no_grad():
            expected = sequence_logps(initial(inputs), targets)
        got = task.reference_logps[split]
        torch.testing.assert_close(got, torch.stack(expected.chunk(2), dim=1), atol=1e-5, rtol=0)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = _task()
    trainer2 = quiet_trainer(max_steps=3, limit_val_batches=1, val_check_interval=3)
    trainer2.fit(resumed, datamodule=data, ckpt_path=str(ckpt))
    assert torch.equal(resumed.reference_logps["train"], task.reference_logps["train"])


def test_bad_pairs_are_skipped_by_file_and_line(tokenizer, tmp_path, caplog):
    good = json.dumps(STRING_PAIRS[0])
    path = tmp_path / "pairs.jsonl"
    lines = [good, json.dumps({"prompt": "x", "chosen": "y"}), "[oops",
             json.dumps({"prompt": "x", "chosen": 3, "rejected": "z"}), *[good] * 4]  # fmt: skip
    path.write_text("".join(line + "\n" for line in lines))
    with caplog.at_level(logging.WARNING):
        data = _data(tokenizer, tmp_path, path, val_files=str(path), batch_size=2)
    for line, why in [(2, "no 'rejected' field"), (3, "not JSON"), (4, "chosen is int")]:
        assert f"{path} line {line}: {why}" in caplog.text
    assert len(data.splits["train"][0]) == 5


def test_config_checks():
    validate_config(compose_config(["experiment=llama_dpo"]))
    with pytest.raises(ConfigError, match="use data=preference"):
        validate_config(compose_config(["experiment=llama_dpo", "data=chat"]))
    with pytest.raises(ConfigError, match=r"reference=adapters .* has none"):
        validate_config(compose_config(["experiment=llama_dpo", "~task.lora",
                                        "task.reference=adapters"]))  # fmt: skip
    with pytest.raises(ConfigError, match="task=dpo with strategy"):
        validate_config(compose_config(["experiment=llama_dpo", "~task.lora", "strategy=nd"]))


@pytest.mark.distributed
def test_ddp_logs_the_global_batch_values_of_one_process(tmp_path):
    """train/loss, the gradient norm and the dpo/ metrics of 2 DDP ranks (2 pairs each) equal
    one process's (4 pairs) at every step, the later steps after updates from the averaged
    gradients (W&B's offline record of each run)."""
    from tests.helpers.runs import QUICK, run_train, wandb_history

    keys = ["train/loss", "train/grad_norm", "dpo/rewards_chosen", "dpo/rewards_rejected",
            "dpo/margins", "dpo/accuracy"]  # fmt: skip
    steps = []
    for name, extra in (("one", []), ("ddp", ["strategy=ddp", "trainer.devices=2"])):
        args = ["experiment=llama_dpo", *QUICK, "trainer.max_steps=3", "task.lr=1e-2",
                "task.warmup_steps=0", f"paths.cache_dir={tmp_path / 'cache'}", *extra]  # fmt: skip
        result = run_train(args, tmp_path / name, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        (run,) = (tmp_path / name / "llama_dpo").glob("*/wandb/offline-run-*")
        steps.append([[row[k] for k in keys] for row in wandb_history(run) if "train/loss" in row])
    assert len(steps[0]) == len(steps[1]) == 3
    assert steps[0][0][0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at first
    for one, ddp in zip(steps[0], steps[1]):
        assert ddp == pytest.approx(one, abs=1e-5), (one, ddp)
    assert steps[0][-1][4] > 0  # the margins grew: the comparison means something


def test_lora_dpo_steps_equal_trl_dpo_trainer_on_peft(tokenizer, tmp_path):
    """A random HF Llama with peft adapters (A and B random) in TRL's ``DPOTrainer`` (sigmoid,
    β 0.1, the reference its adapters off) and the same model and adapters in ``DPOTask``, on
    the same pairs in the same order: the first step's loss, rewards and every adapter gradient
    within 1e-5; then 20 plain AdamW steps (constant learning rate, no clipping, no warm-up) on
    both sides, whose losses track within 1e-4. TRL computes its loss in its own
    ``_compute_loss`` on its own collated batches; only the optimizer loop is written here."""
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    from llmlab.models import from_pretrained
    from llmlab.models.lora import LoRAConfig, load_lora, lora_state_dict, to_peft_state_dict
    from tests.helpers.hf_tiny import build_hf

    hf = build_hf("Llama", dict(vocab_size=384, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    theirs = peft.get_peft_model(
        copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    theirs.save_pretrained(tmp_path / "peft")
    task = _task(lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, beta=0.1)
    task.model = load_lora(from_pretrained(tmp_path / "hf"), tmp_path / "peft").train()
    task.lora = LoRAConfig(r=4, alpha=8)

    records = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                         max_length=None, beta=0.1, loss_type=["sigmoid"])  # fmt: skip
    trainer = trl.DPOTrainer(
        model=theirs, args=args, processing_class=transformers.AutoTokenizer.from_pretrained(
            EXAMPLE_DIR), train_dataset=datasets.Dataset.from_list(records),
    )  # fmt: skip
    # Handed a PeftModel whose adapter exists already, TRL keeps a copy of it as the reference
    # ("ref"); a fresh adapter (B = 0, as task.lora starts) is the base itself, which is what
    # TRL falls back to without that copy: the base, as DPOTask's adapters-off reference.
    trainer.model.delete_adapter("ref")
    trainer.model.train()
    data = _data(tokenizer, tmp_path, val_files=str(PAIRS), val_fraction=0.0)
    ours_set, theirs_set = data.split_dataset("train"), trainer.train_dataset
    columns = ("prompt_ids", "chosen_ids", "rejected_ids")

    def batches(step):
        rows = [(step * 4 + i) % len(records) for i in range(4)]
        mine = data.collate([ours_set[i] for i in rows])
        trl_batch = trainer.data_collator([{k: theirs_set[i][k] for k in columns} for i in rows])
        return mine, trl_batch

    ours_params = list(lora_state_dict(task.model).values())
    theirs_params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in ours_params) == sum(p.numel() for p in theirs_params)
    opt_ours = torch.optim.AdamW(ours_params, lr=1e-2, weight_decay=0.0)
    opt_theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=0.0)
    for step in range(20):
        mine, trl_batch = batches(step)
        losses, metrics = task.pair_losses("train", mine)
        loss_ours = losses.mean()
        loss_theirs = trainer._compute_loss(trainer.model, trl_batch, return_outputs=False)
        assert abs(float(loss_ours) - float(loss_theirs)) < 1e-4, step
        loss_ours.backward()
        loss_theirs.backward()
        if step == 0:
            assert abs(float(loss_ours) - float(loss_theirs)) < 1e-5
            logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
            for ours_name, trl_name in (("rewards_chosen", "rewards/chosen"),
                                        ("rewards_rejected", "rewards/rejected")):  # fmt: skip
                assert float(metrics[ours_name].mean()) == pytest.approx(logged[trl_name],
                                                                         abs=1e-5)  # fmt: skip
            grads = to_peft_state_dict(
                task.model, {k: p.grad for k, p in lora_state_dict(task.model).items()}
            )
            named = trainer.model.named_parameters()
            peft_grads = {n.replace(".default", ""): p.grad for n, p in named if p.requires_grad}
            assert sorted(grads) == sorted(peft_grads)
            for key, grad in peft_grads.items():
                assert grad.abs().max() > 0, key
                torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=0, msg=key)
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
    assert float(loss_ours) < math.log(2) - 0.05  # it learned: the comparison means something
