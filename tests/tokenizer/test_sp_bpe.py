"""SentencePiece BPE with byte fallback against ``sentencepiece`` and HF ``tokenizers`` loading
the same model: ids equal on random Unicode text (emoji, unseen scripts, control characters,
long whitespace runs), for models sentencepiece trained and for the one llmlab trains."""

from __future__ import annotations

import io
import json

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers.convert_slow_tokenizer import SpmConverter

import llmlab.tokenizer as lt
from llmlab.tokenizer import SentencePieceBPETokenizer
from tests.tokenizer.corpus import MIXED, held_out_text, train_files, unicode_texts

HYPOTHESIS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# sentencepiece training settings: its defaults (nmt_nfkc normalization), with and without byte
# fallback, and Llama 2's (identity, spaces kept, byte fallback, digits split) + user symbols
SP_MODELS = {
    "nmt_nfkc-byte_fallback": dict(byte_fallback=True),
    "nmt_nfkc-unk": dict(character_coverage=0.99),
    "llama": dict(
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["<|im_start|>", "\n"],
    ),
}


def _lines(megabytes: float) -> list[str]:
    return [ln for f in train_files(megabytes) for ln in f.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return _lines(0.15)


def _sp_trained(name: str, lines: list[str], folder, cache={}):  # noqa: B006 - once per model
    """(name, path of a .model sentencepiece trained, its SentencePieceProcessor)."""
    if name not in cache:
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
            vocab_size=800, model_type="bpe", num_threads=1, minloglevel=2,
            **SP_MODELS[name])  # fmt: skip
        path = folder / f"{name}.model"
        path.write_bytes(model.getvalue())
        cache[name] = (name, path, spm.SentencePieceProcessor(model_file=str(path)))
    return cache[name]


@pytest.fixture(scope="module", params=sorted(SP_MODELS))
def sp_model(request, lines, tmp_path_factory):
    return _sp_trained(request.param, lines, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def llama_model(lines, tmp_path_factory):
    return _sp_trained("llama", lines, tmp_path_factory.getbasetemp())


def _hf_from_model(path, legacy: bool) -> Tokenizer:
    """HF's own conversion of a .model (transformers' SpmConverter)."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=legacy)


@HYPOTHESIS
@given(text=unicode_texts())
def test_model_file_ids_equal_sentencepiece(sp_model, text):
    _, path, sp = sp_model
    ours = _loaded(path)
    assert ours.encode_ordinary(text) == sp.encode(text)


def _loaded(path, cache={}):  # noqa: B006 - one load per model file across examples
    if path not in cache:
        cache[path] = lt.load(path)
    return cache[path]


def test_held_out_text_and_decode_equal_sentencepiece(sp_model):
    _, path, sp = sp_model
    ours = lt.load(path)
    assert isinstance(ours, SentencePieceBPETokenizer)
    for text in (held_out_text(100_000), MIXED):
        ids = sp.encode(text)
        assert ours.encode_ordinary(text) == ids
        assert ours.decode(ids) == sp.decode(ids)
    invalid = [sp.piece_to_id("<0xE4>"), sp.piece_to_id("<0xB8>"), sp.piece_to_id("a")]
    if SP_MODELS[sp_model[0]].get("byte_fallback"):  # a cut UTF-8 sequence: one U+FFFD a byte
        assert ours.decode(invalid) == sp.decode(invalid)


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "prepend-first"])
def test_hf_conversion_ids_equal_hf(sp_model, legacy, tmp_path):
    """HF reading the same model (its converter's tokenizer.json), and llmlab reading that file."""
    _, path, _ = sp_model
    hf = _hf_from_model(path, legacy)
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = lt.load(tmp_path / "tokenizer.json")
    assert isinstance(ours, SentencePieceBPETokenizer)

    _ids_equal_hf_on_random_text(ours, hf)
    for text in (held_out_text(50_000), MIXED):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


def _ids_equal_hf_on_random_text(ours, hf: Tokenizer) -> None:
    @HYPOTHESIS
    @given(text=unicode_texts())
    def check(text):
        expected = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allowed_special="all") == expected

    check()


def _llama_style(path, layout: str) -> Tokenizer:
    """The pipelines real HF files carry around the same BPE model: Llama 2's legacy one
    (Prepend + Replace normalizer), Mistral's (Metaspace, prepend_scheme="first", no split) and
    Gemma's (spaces replaced, no prefix)."""
    data = json.loads(_hf_from_model(path, legacy=True).to_str())["model"]
    bpe = models.BPE(
        {t: i for t, i in data["vocab"].items()},
        [tuple(m) for m in data["merges"]],
        unk_token="<unk>",
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    if layout == "llama2-legacy":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    elif layout == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@pytest.mark.parametrize("layout", ["llama2-legacy", "mistral", "gemma"])
def test_real_world_layouts_load_and_encode_like_hf(llama_model, layout, tmp_path):
    _, path, _ = llama_model
    hf = _llama_style(path, layout)
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = lt.load(tmp_path / "tokenizer.json")

    _ids_equal_hf_on_random_text(ours, hf)
    text = "<s>Hello  world</s>\n  indented 12345 🙂"
    assert ours.encode(text, allowed_special="all") == hf.encode(text).ids
    assert ours.decode(hf.encode(MIXED).ids) == hf.decode(hf.encode(MIXED).ids)


# --------------------------------------------------------------------------- llmlab's trainer
@pytest.fixture(scope="module")
def trained(lines, tmp_path_factory):
    tok = SentencePieceBPETokenizer.train(
        lines, 1200, user_defined_symbols=["<|im_start|>"], character_coverage=0.9995
    )
    path = tok.save(tmp_path_factory.mktemp("ours") / "ours.model", format="sentencepiece")
    return tok, spm.SentencePieceProcessor(model_file=str(path)), path


@HYPOTHESIS
@given(text=unicode_texts())
def test_trained_model_loads_in_sentencepiece_and_encodes_identically(trained, text):
    tok, sp, _ = trained
    assert tok.encode_ordinary(text) == sp.encode(text)


def test_trained_model_layout_and_round_trips(trained, lines, tmp_path):
    tok, sp, _ = trained
    assert tok.vocab_size == sp.get_piece_size() == 1200
    assert [tok.id_to_token(i) for i in (0, 1, 2, 3, 4)] == [
        "<unk>",
        "<s>",
        "</s>",
        "<|im_start|>",
        "<0x00>",
    ]
    assert sp.is_byte(4) and sp.is_control(1) and sp.is_unknown(0)
    scores = [s for _, s, kind in tok.pieces if kind == "normal"]
    assert scores == sorted(scores, reverse=True)  # learned earlier merges first
    held = held_out_text(50_000)
    assert tok.encode(held) == sp.encode(held)
    assert tok.decode(tok.encode(MIXED)) == sp.decode(sp.encode(MIXED)) == MIXED
    again = SentencePieceBPETokenizer.train(lines, 1200, user_defined_symbols=["<|im_start|>"])
    assert again.pieces == tok.pieces  # deterministic
    for fmt, name in (
        ("llmlab", "own.json"),
        ("hf", "tokenizer.json"),
        ("sentencepiece", "re.model"),
    ):
        loaded = lt.load(tok.save(tmp_path / name, format=fmt))
        assert loaded.encode(held) == tok.encode(held), fmt
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.encode(held).ids == tok.encode(held)


def test_special_tokens_and_apis(trained):
    tok, _, _ = trained
    with pytest.raises(ValueError, match="disallowed special token '<s>'"):
        tok.encode("<s>hello")
    assert tok.encode("<s>hello", allowed_special="all")[0] == tok.bos_token_id == 1
    texts = ["hello world", "", "  two  spaces"]
    assert tok.encode_ordinary_batch(texts) == [tok.encode_ordinary(t) for t in texts]
    ids = tok.encode("naïve café 🙂")
    text, offsets = tok.decode_with_offsets(ids)
    assert text == "naïve café 🙂" and offsets == sorted(offsets) and offsets[0] == 0
    with pytest.raises(ValueError, match="token id 5000 is not in this vocabulary"):
        tok.decode([5000])


def test_unsupported_models_are_refused_by_name(llama_model, lines, tmp_path):
    _, path, _ = llama_model
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    proto.trainer_spec.treat_whitespace_as_suffix = True
    (tmp_path / "suffix.model").write_bytes(proto.SerializeToString())
    with pytest.raises(lt.TokenizerFileError, match="treat_whitespace_as_suffix"):
        lt.load(tmp_path / "suffix.model")
    unigram = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines[:1500]), model_writer=unigram,
        vocab_size=300, model_type="unigram", minloglevel=2)  # fmt: skip
    (tmp_path / "unigram.model").write_bytes(unigram.getvalue())
    with pytest.raises(lt.TokenizerFileError, match="model_type 'unigram'"):
        lt.load(tmp_path / "unigram.model")
    hf_loaded = lt.load(_save_hf(path, tmp_path))
    with pytest.raises(ValueError, match=r"came from a tokenizer\.json"):
        hf_loaded.save(tmp_path / "x.model", format="sentencepiece")


def _save_hf(path, tmp_path):
    out = tmp_path / "tokenizer.json"
    _hf_from_model(path, legacy=True).save(str(out))
    return out


@pytest.mark.slow
def test_training_on_the_whole_corpus_equals_hf_and_encodes_like_sentencepiece(tmp_path):
    """At vocab 32k on ~10 MB: llmlab's merges equal HF ``BpeTrainer``'s on the same words (spaces
    as "▁", a dummy prefix, cut before each "▁"-run), and sentencepiece loading llmlab's .model
    encodes the held-out text identically."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

    lines = [ln for f in train_files(None) for ln in f.read_text(encoding="utf-8").split("\n")]
    ours = SentencePieceBPETokenizer.train(lines, 32768, character_coverage=1.0)
    hf = Tokenizer(models.BPE())
    hf.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁"), normalizers.Prepend("▁")])
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("▁*[^▁]+|▁+"), behavior="isolated")
    hf.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=32768 - 259, show_progress=False))
    merged = [p for p, _, kind in ours.pieces if kind == "normal" and len(p) > 1]
    merges = json.loads(hf.to_str())["model"]["merges"]
    assert merged == ["".join(m.split(" ") if isinstance(m, str) else m) for m in merges]
    sp = spm.SentencePieceProcessor(
        model_file=str(ours.save(tmp_path / "o.model", "sentencepiece"))
    )
    held = held_out_text(None)
    assert ours.encode(held) == sp.encode(held)
