"""``data=chat`` (llmlab.train.chat): assistant-only targets equal transformers'
``apply_chat_template(return_assistant_tokens_mask=True)`` and TRL's ``SFTTrainer`` labels
(``assistant_only_loss=True``) on the same conversations and template; packed rows keep each
conversation to itself (a Llama's logits on a packed row equal each conversation's alone, within
1e-5 in fp32); bad records are skipped and counted by file and line, or refused under strict."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from llmlab.parallel.loss_mean import IGNORE_INDEX
from llmlab.tokenizer import load
from llmlab.train.chat import (
    EXAMPLE_DIR,
    ChatDataModule,
    ChatTemplate,
    example_of,
    pack,
    tokenize_spans,
)

CONVERSATIONS = EXAMPLE_DIR / "conversations.jsonl"
# Edge cases beyond the shipped file: an assistant turn first, two in a row, unicode, an empty
# answer, a long system prompt.
EXTRA = [
    [{"role": "assistant", "content": "Hello! Ask me anything."},
     {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}],
    [{"role": "user", "content": "Say hi twice"}, {"role": "assistant", "content": "hi"},
     {"role": "assistant", "content": "hi again"}],
    [{"role": "user", "content": "Déjà vu — naïve café? 日本"},
     {"role": "assistant", "content": "Oui: café ☕ 日本語"}],
    [{"role": "system", "content": "Be brief. " * 5}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": ""}],
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return load(EXAMPLE_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def conversations():
    shipped = [json.loads(line)["messages"] for line in CONVERSATIONS.read_text().splitlines()]
    return shipped + EXTRA


def test_masks_equal_transformers_apply_chat_template(tokenizer, conversations):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(EXAMPLE_DIR)
    template = ChatTemplate.from_path(EXAMPLE_DIR)
    for messages in conversations:
        text, spans = template.render(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False)
        ids, mask = tokenize_spans(tokenizer, text, spans)
        ref = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids.tolist() == ref["input_ids"]
        assert mask.astype(int).tolist() == ref["assistant_masks"], messages


def test_targets_equal_trl_sft_trainer_labels(tokenizer, conversations, tmp_path):
    """TRL's SFTTrainer(assistant_only_loss=True) labels each token (-100 off the assistant's);
    our targets are the labels of the next token: targets == labels[1:]."""
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(EXAMPLE_DIR)
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    usable = [m for m in conversations if any(x["content"] for x in m if x["role"] == "assistant")]
    args = trl.SFTConfig(
        output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, packing=False,
        report_to=[], use_cpu=True,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model, args=args, processing_class=hf_tok,
        train_dataset=datasets.Dataset.from_list([{"messages": m} for m in usable]),
    )  # fmt: skip
    template = ChatTemplate.from_path(EXAMPLE_DIR)
    for messages, row in zip(usable, trainer.train_dataset, strict=True):
        ids, mask = tokenize_spans(tokenizer, *template.render(messages))
        example, cut = example_of(ids, mask, block_size=len(ids))
        assert not cut
        assert ids.tolist() == row["input_ids"]
        assert example.targets.tolist() == row["labels"][1:]


def test_packed_rows_keep_each_conversation_to_itself(tokenizer, conversations):
    """Every conversation lands in exactly one row, whole; a Llama over a packed row with its
    document ids gives each conversation the logits it gets alone."""
    from llmlab.models import build_model

    template = ChatTemplate.from_path(EXAMPLE_DIR)
    examples = [
        example_of(*tokenize_spans(tokenizer, *template.render(m)), 96)[0]
        for m in conversations[:12]
    ]
    inputs, targets, docs = pack(examples, 96, pad_id=0)
    assert len(inputs) < len(examples)  # packed, not one per row
    placed = []
    for r in range(len(inputs)):
        for d in np.unique(docs[r]):
            span = np.flatnonzero(docs[r] == d)
            assert (np.diff(span) == 1).all()  # contiguous
            placed.append((r, span))
    torch.manual_seed(0)
    model = build_model(dict(arch="llama", vocab_size=384, block_size=96, n_layer=2, n_head=4,
                             n_kv_head=2, n_embd=32, intermediate_size=64)).eval()  # fmt: skip
    with torch.no_grad():
        packed = model(torch.from_numpy(inputs), document_ids=torch.from_numpy(docs))
    found = 0
    for ex in examples:
        n = len(ex.inputs)
        matches = [
            (r, s)
            for r, s in placed
            if len(s) == n
            and (inputs[r, s] == ex.inputs).all()
            and (targets[r, s] == ex.targets).all()
        ]
        assert matches, "a conversation is missing from the packed rows"
        r, span = matches[0]
        with torch.no_grad():
            alone = model(torch.from_numpy(ex.inputs)[None])
        torch.testing.assert_close(packed[r, span], alone[0], atol=1e-5, rtol=0)
        found += 1
    assert found == len(examples)
    # padding is its own document and never a target
    assert ((targets != IGNORE_INDEX).sum()) == sum(
        (e.targets != IGNORE_INDEX).sum() for e in examples
    )


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello there"}]})  # fmt: skip


def test_bad_records_skipped_and_counted_by_file_and_line(tokenizer, tmp_path, caplog):
    bad = _write(tmp_path / "chats.jsonl", [
        GOOD, "{not json", json.dumps({"text": "no messages"}), GOOD, "",
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps([1, 2]), *[GOOD] * 10,
    ])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        data = ChatDataModule(str(bad), tokenizer, template=str(EXAMPLE_DIR), block_size=32,
                              batch_size=1, val_files=str(_write(tmp_path / "v.jsonl", [GOOD])),
                              cache_dir=str(tmp_path / "cache"))  # fmt: skip
    text = caplog.text
    for line, why in [(2, "not JSON"), (3, "no 'messages'"), (6, "no string 'content'"),
                      (7, "no assistant message"), (8, "not a JSON object")]:  # fmt: skip
        assert f"{bad} line {line}: " in text and why in text, (line, text)
    assert "skipped 5 bad record(s) of 18" in text and "data.strict=true" in text
    assert data.report.skipped == 5
    batch = next(iter(data.loader("train")))
    assert len(batch) == 3 and batch[0].shape == (1, 32)

    with pytest.raises(ValueError, match=rf"{bad} line 2: not JSON"):
        ChatDataModule(str(bad), tokenizer, template=str(EXAMPLE_DIR), block_size=32,
                       batch_size=1, strict=True, cache_dir=str(tmp_path / "cache"))  # fmt: skip


def test_a_template_without_generation_marks_is_refused(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="no \\{% generation %\\}"):
        ChatTemplate.from_path(tmp_path)


def test_too_few_rows_for_a_batch_is_refused(tokenizer, tmp_path):
    path = _write(tmp_path / "c.jsonl", [GOOD] * 3)
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        ChatDataModule(str(path), tokenizer, template=str(EXAMPLE_DIR), block_size=64,
                       batch_size=8, val_files=str(path), cache_dir=str(tmp_path))  # fmt: skip


@pytest.mark.distributed
def test_lora_sft_from_a_hugging_face_folder_through_the_app(tmp_path):
    """``llama_sft_lora`` on an HF Llama folder holding the example's tokenizer and template
    (``model=pretrained tokenizer=pretrained``): it trains, and its checkpoint holds the
    adapters alone (the base is the folder)."""
    import shutil

    from tests.helpers.hf_tiny import build_hf
    from tests.helpers.runs import QUICK, run_train

    folder = tmp_path / "instruct"
    build_hf("Llama", dict(vocab_size=384, max_position_embeddings=256)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLE_DIR / name, folder / name)
    args = ["experiment=llama_sft_lora", *QUICK, "model=pretrained", "tokenizer=pretrained",
            f"model.init_from={folder}", f"paths.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    result = run_train(args, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "assistant targets" in result.stdout
    (ckpt,) = (tmp_path / "out" / "llama_sft_lora").glob("*/checkpoints/last.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert state and all("lora_" in k for k in state)

    # the merged export leaves with the template it was trained on
    import transformers

    from llmlab.train.export import export

    out = export(ckpt, tmp_path / "export")
    exported = transformers.AutoTokenizer.from_pretrained(out)
    example = transformers.AutoTokenizer.from_pretrained(EXAMPLE_DIR)
    messages = json.loads(CONVERSATIONS.read_text().splitlines()[0])["messages"]
    assert exported.apply_chat_template(messages, tokenize=False) == (
        example.apply_chat_template(messages, tokenize=False)
    )
