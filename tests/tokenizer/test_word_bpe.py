"""End-of-word BPE against HF ``tokenizers`` (``BpeTrainer(end_of_word_suffix="</w>")`` and
``BPE(end_of_word_suffix="</w>")``): the same merges and vocabulary in order, the same ids on
random Unicode text both ways through ``tokenizer.json``, and the vocab + merges files."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import llmlab.tokenizer as lt
from llmlab.tokenizer import WordBPETokenizer
from tests.tokenizer.corpus import MIXED, held_out_text, train_files, unicode_texts
from tests.tokenizer.hf_bpe import hf_merges

SUFFIX = "</w>"
# name -> (llmlab normalizer, llmlab pre-tokenizer, HF normalizer, HF pre-tokenizer)
PIPELINES = {
    "whitespace": (None, "whitespace", None, pre_tokenizers.Whitespace()),
    "bert-lowercase": (
        "lowercase",
        "bert",
        normalizers.Lowercase(),
        pre_tokenizers.BertPreTokenizer(),
    ),
}


def hf_trained(files, vocab_size: int, normalizer, pre_tokenizer, specials=("<unk>",)):
    tok = Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix=SUFFIX))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.BPEDecoder(suffix=SUFFIX)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        end_of_word_suffix=SUFFIX,
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def hf_initial_layout(tok, n_specials: int) -> list[str]:
    """HF's ids between the special tokens and the first merge: the alphabet, then its
    ``</w>`` forms in an order HF takes from a per-process random hash."""
    vocab = tok.get_vocab()
    order = sorted(vocab, key=vocab.get)
    return order[n_specials : len(order) - len(hf_merges(tok))]


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def pair(request):
    """(HF, llmlab) trained on the same ~0.3 MB at vocab 1500 with the same pipeline."""
    norm, pre, hf_norm, hf_pre = PIPELINES[request.param]
    files = train_files(0.3)
    hf = hf_trained(files, 1500, hf_norm, hf_pre)
    ours = WordBPETokenizer.train_from_files(
        files, 1500, normalizer=norm, pre_tokenizer=pre, initial_tokens=hf_initial_layout(hf, 1)
    )
    return hf, ours


def test_training_equals_hf_in_order(pair):
    hf, ours = pair
    assert ours.merges == hf_merges(hf)  # the whole merge list, in order
    assert ours.vocab == hf.get_vocab()  # id for id
    assert ours.vocab_size == 1500 and any(t.endswith(SUFFIX) for t in ours.vocab)


def test_default_layout_is_deterministic_and_documented():
    files = train_files(0.1)
    a = WordBPETokenizer.train_from_files(files, 600)
    b = WordBPETokenizer.train_from_files(files, 600)
    assert a.merges == b.merges and a.vocab == b.vocab
    # after the specials: the alphabet by code point, then its "</w>" forms sorted
    layout = sorted(a.vocab, key=a.vocab.get)[1 : 1 + 2 * len({c for t in a.vocab for c in t})]
    alphabet = [t for t in layout if len(t) == 1]
    assert alphabet == sorted(alphabet)
    with pytest.raises(ValueError, match="initial_tokens must be exactly"):
        WordBPETokenizer.train_from_files(files, 600, initial_tokens=["a", "b"])


def test_hf_trained_file_loads_and_encodes_like_hf(pair, tmp_path):
    hf, _ = pair
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = lt.load(tmp_path / "tokenizer.json")
    assert isinstance(loaded, WordBPETokenizer)
    for text in (held_out_text(50_000), MIXED):
        expected = hf.encode(text).ids
        assert loaded.encode(text) == expected
        assert loaded.decode(expected) == hf.decode(expected, skip_special_tokens=False)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=unicode_texts())
def test_random_unicode_ids_equal_hf_both_ways(pair, tmp_path_factory, text):
    hf, ours = pair
    folder = tmp_path_factory.getbasetemp()
    path = folder / f"ours-{id(ours)}.json"
    if not path.exists():
        ours.save(path, format="hf")
    exported = Tokenizer.from_file(str(path))
    expected = hf.encode(text).ids
    assert ours.encode(text, disallowed_special=()) == expected  # llmlab = HF
    assert exported.encode(text).ids == expected  # HF reading llmlab's file = HF


def test_vocab_merges_files_and_every_format_round_trip(pair, tmp_path):
    _, ours = pair
    options = {
        "normalizer": ours.pipeline.normalizer_spec,
        "pre_tokenizer": ours.pipeline.pre_tokenizer_spec,
    }
    folder = ours.save(tmp_path / "subword-nmt", format="vocab_merges")
    assert (folder / "merges.txt").read_text().startswith("#version: 0.2\n")
    for path, kwargs in (
        (folder, options),
        (folder / "vocab.json", options),
        (ours.save(tmp_path / "own.json"), {}),
        (ours.save(tmp_path / "tokenizer.json", format="hf"), {}),
    ):
        again = lt.load(path, **kwargs)
        assert isinstance(again, WordBPETokenizer)
        assert again.merges == ours.merges and again.vocab == ours.vocab
        assert again.encode(MIXED) == ours.encode(MIXED)


def test_byte_level_pipeline_with_suffix_loads_like_hf(tmp_path):
    """CLIP's layout: a byte-level alphabet and "</w>" on each word's last symbol."""
    tok = Tokenizer(models.BPE(end_of_word_suffix=SUFFIX))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        end_of_word_suffix=SUFFIX,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in train_files(0.1)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = lt.load(tmp_path / "tokenizer.json")
    assert isinstance(ours, WordBPETokenizer)
    for text in (held_out_text(20_000), MIXED):
        assert ours.encode(text) == tok.encode(text).ids


def test_unsupported_fields_are_refused_by_name(pair, tmp_path):
    hf, _ = pair
    data = json.loads(hf.to_str())
    data["model"]["dropout"] = 0.1
    (tmp_path / "dropout.json").write_text(json.dumps(data))
    with pytest.raises(lt.TokenizerFileError, match="dropout"):
        lt.load(tmp_path / "dropout.json")
    data = json.loads(hf.to_str())
    data["pre_tokenizer"] = {"type": "UnicodeScripts"}
    (tmp_path / "scripts.json").write_text(json.dumps(data))
    with pytest.raises(lt.TokenizerFileError, match="pre-tokenizer 'UnicodeScripts'"):
        lt.load(tmp_path / "scripts.json")


def test_batch_and_offset_apis(pair):
    _, ours = pair
    texts = ["Hello there, world.", "", "To be, or not to be"]
    assert ours.encode_ordinary_batch(texts) == [ours.encode_ordinary(t) for t in texts]
    ids = [ours.encode(t) for t in texts]
    assert ours.decode_batch(ids) == [ours.decode(i) for i in ids]
    text, offsets = ours.decode_with_offsets(ids[0])
    assert text == ours.decode(ids[0]) and text.lower() == "hello there , world ."
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(ids[0])
    with pytest.raises(ValueError, match=r"token id 99999 is not in this vocabulary"):
        ours.decode([99999])


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [8192, 32768])
def test_training_equals_hf_on_the_whole_corpus(vocab_size):
    files = train_files(None)
    hf = hf_trained(files, vocab_size, None, pre_tokenizers.Whitespace())
    ours = WordBPETokenizer.train_from_files(
        files, vocab_size, initial_tokens=hf_initial_layout(hf, 1)
    )
    assert ours.merges == hf_merges(hf) and ours.vocab == hf.get_vocab()
