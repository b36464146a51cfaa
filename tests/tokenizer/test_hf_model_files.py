"""The ``tokenizer.json`` layouts of HF model folders load through one ``load(path)`` and encode
like HF: Llama 3 (Split + ByteLevel, ``ignore_merges``, many special tokens, a BOS template),
Qwen2 (an NFC normalizer), GPT-2 (ByteLevel with its own regex). What llmlab does not implement
is refused with a message naming the field, never loaded approximately. (SentencePiece layouts —
Llama 2, Mistral, Gemma — are in ``test_sp_bpe.py``.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

import llmlab.tokenizer as lt
from llmlab.tokenizer import BPETokenizer
from tests.tokenizer.corpus import MIXED, held_out_text, train_files, unicode_texts

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [
    f"<|reserved_special_token_{i}|>" for i in range(4)
]


def _hf_byte_level(layout: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=layout == "llama3"))
    if layout == "qwen2":
        tok.normalizer = normalizers.NFC()
    if layout == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = pre_tokenizers.Split(Regex(LLAMA3 if layout == "llama3" else QWEN2), "isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train([str(f) for f in train_files(0.15)], trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok


def _model_folder(layout: str, base, cache={}):  # noqa: B006 - one folder per layout
    """An HF model folder's tokenizer files: (layout, folder, HF tokenizer)."""
    if layout not in cache:
        hf = _hf_byte_level(layout)
        folder = base / layout
        folder.mkdir()
        hf.save(str(folder / "tokenizer.json"))
        cache[layout] = layout, folder, hf
    return cache[layout]


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gpt2"])
def model_folder(request, tmp_path_factory):
    return _model_folder(request.param, tmp_path_factory.getbasetemp())


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=unicode_texts())
def test_folder_loads_and_encodes_like_hf(model_folder, text):
    _, folder, hf = model_folder
    ours = _load(folder)
    assert ours.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False).ids


def _load(folder, cache={}):  # noqa: B006 - one load per folder across examples
    if folder not in cache:
        cache[folder] = lt.load(folder)
    return cache[folder]


def test_special_tokens_normalizer_and_round_trip(model_folder, tmp_path):
    layout, folder, hf = model_folder
    ours = lt.load(folder)
    assert isinstance(ours, BPETokenizer)
    assert ours.special_tokens == {t: hf.token_to_id(t) for t in SPECIALS}
    assert ours.normalizer == ("NFC" if layout == "qwen2" else None)
    text = "<|begin_of_text|>Café\u0301 naïve<|end_of_text|>" + held_out_text(20_000)
    assert ours.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False).ids
    assert ours.decode(hf.encode(MIXED).ids) == hf.decode(
        hf.encode(MIXED).ids, skip_special_tokens=False
    )
    again = Tokenizer.from_file(str(ours.save(tmp_path / "tokenizer.json", format="hf")))
    assert again.encode(text, add_special_tokens=False).ids == ours.encode(
        text, allowed_special="all"
    )


def _refused(folder, tmp_path, edit, match: str) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(lt.TokenizerFileError, match=match):
        lt.load(tmp_path / "tokenizer.json")


def test_unsupported_fields_are_refused_by_name(tmp_path_factory, tmp_path):
    _, folder, _ = _model_folder("llama3", tmp_path_factory.getbasetemp())
    _refused(folder, tmp_path, lambda d: d["model"].update(dropout=0.1), "dropout")
    _refused(folder, tmp_path, lambda d: d.update(normalizer={"type": "Nmt"}), "normalizer 'Nmt'")
    _refused(
        folder,
        tmp_path,
        lambda d: d["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits"}),
        "pre-tokenizer 'Sequence' is not supported",
    )
    _refused(
        folder,
        tmp_path,
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        "add_prefix_space=true",
    )
    _refused(folder, tmp_path, lambda d: d["added_tokens"][0].update(lstrip=True), "lstrip=true")
    _refused(folder, tmp_path, lambda d: d["model"].update(type="WordLevel"), "'WordLevel'")
