"""tiktoken's API on llmlab's byte-level BPE, checked with tiktoken's own test examples
(openai/tiktoken ``tests/test_encoding.py`` and ``tests/test_offsets.py``): the real GPT-2 and
cl100k_base vocabularies loaded into llmlab give tiktoken's ids, batches, offsets and special
tokens, on the tiktoken fast path and on the pure-Python reference encoder alike. The one
deliberate difference: an unknown id raises an error that names it (a ``ValueError``, and still
the ``KeyError`` tiktoken raises)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmlab.tokenizer as lt
from llmlab.tokenizer.errors import UnknownTokenError
from tests.tokenizer.corpus import gpt2_files, tiktoken_encoding, tiktoken_gz

BACKENDS = ["tiktoken", "reference"]
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def cl100k_reference(tmp_path_factory):
    return tiktoken_encoding("cl100k_base", tmp_path_factory.mktemp("tiktoken-cache"))


@pytest.fixture(scope="module")
def loaded(cl100k_reference):
    """(GPT-2, cl100k_base) loaded once into llmlab from the offline files."""
    reference = cl100k_reference
    specials = {t: reference.encode_single_token(t) for t in reference.special_tokens_set}
    cl100k = lt.load(tiktoken_gz("cl100k_base"), pattern="cl100k_base", special_tokens=specials)
    return lt.load(gpt2_files()[0]), cl100k


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def gpt2(loaded, backend):
    return loaded[0].with_backend(backend)


@pytest.fixture(scope="module")
def cl100k(loaded, backend):
    return loaded[1].with_backend(backend)


def test_simple(gpt2, cl100k):
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.decode([31373, 995]) == "hello world"
    assert gpt2.encode("hello <|endoftext|>", allowed_special="all") == [31373, 220, 50256]
    assert cl100k.encode("hello world") == [15339, 1917]
    assert cl100k.decode([15339, 1917]) == "hello world"
    assert cl100k.encode("hello <|endoftext|>", allowed_special="all") == [15339, 220, 100257]
    for tok in (gpt2, cl100k):
        for token in range(10_000):
            assert tok.encode_single_token(tok.decode_single_token_bytes(token)) == token


def test_simple_repeated(gpt2):
    expected = {"0": [15], "00": [405], "000": [830], "0000": [2388], "00000": [20483],
                "000000": [10535], "0000000": [24598], "00000000": [8269],
                "000000000": [10535, 830], "0000000000": [8269, 405],
                "0000000000000000": [25645], "00000000000000000": [8269, 10535, 830]}  # fmt: skip
    for text, ids in expected.items():
        assert gpt2.encode(text) == ids


def test_special_token(cl100k):
    eot = cl100k.encode_single_token("<|endoftext|>")
    assert eot == cl100k.eot_token == cl100k.token_to_id(b"<|endoftext|>") == 100257
    assert cl100k.encode_single_token(b"<|endoftext|>") == eot  # special tokens by their bytes
    fip = cl100k.encode_single_token("<|fim_prefix|>")
    fim = cl100k.encode_single_token("<|fim_middle|>")
    text = "<|endoftext|> hello <|fim_prefix|>"
    assert eot not in cl100k.encode(text, disallowed_special=())
    for disallowed in ("all", {"<|endoftext|>"}, {"<|fim_prefix|>"}):
        with pytest.raises(ValueError):
            cl100k.encode(text, disallowed_special=disallowed)
    with pytest.raises(ValueError):
        cl100k.encode(text)
    text = "<|endoftext|> hello <|fim_prefix|> there <|fim_middle|>"
    cases = [
        (dict(disallowed_special=()), set()),
        (dict(allowed_special="all", disallowed_special=()), {eot, fip, fim}),
        (dict(allowed_special="all", disallowed_special="all"), {eot, fip, fim}),
        (dict(allowed_special={"<|fim_prefix|>"}, disallowed_special=()), {fip}),
        (dict(allowed_special={"<|endoftext|>"}, disallowed_special=()), {eot}),
        (dict(allowed_special={"<|fim_middle|>"}, disallowed_special=()), {fim}),
    ]
    for kwargs, present in cases:
        tokens = set(cl100k.encode(text, **kwargs))
        assert tokens & {eot, fip, fim} == present, kwargs


def test_batch_encode(gpt2, cl100k):
    for tok in (gpt2, cl100k):
        text1, text2 = "hello world", "goodbye world"
        assert tok.encode_batch([text1]) == [tok.encode(text1)]
        assert tok.encode_batch([text1, text2]) == [tok.encode(text1), tok.encode(text2)]
        assert tok.encode_ordinary_batch([text1]) == [tok.encode_ordinary(text1)]
        assert tok.encode_ordinary_batch([text1, text2], num_threads=2) == [
            tok.encode_ordinary(text1),
            tok.encode_ordinary(text2),
        ]


@HYPOTHESIS
@given(batch=st.lists(st.text()))
def test_hyp_batch_roundtrip(cl100k, cl100k_reference, batch):
    encoded = cl100k.encode_batch(batch, allowed_special="all")
    assert encoded == [cl100k.encode(t, allowed_special="all") for t in batch]
    assert encoded == cl100k_reference.encode_batch(batch, allowed_special="all")
    assert cl100k.decode_batch(encoded) == cl100k_reference.decode_batch(encoded)


def test_basic_offsets(cl100k):
    examples = {
        "hello world": [0, 5],
        "hello world<|endoftext|> green cow": [0, 5, 11, 24, 30],
        "我非常渴望与人工智能一起工作": [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13],
        # b'\xe0\xae\xbf\xe0\xae' and b'\xe0\xaf\x8d\xe0\xae': a token ending mid-character
        "நடிகர் சூர்யா": [0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 9, 10, 11, 12, 12],
        " Ġ除": [0, 1],  # b'\xa0\xe9\x99\xa4': a token starting with a continuation byte
    }
    for prompt, offsets in examples.items():
        assert cl100k.decode_with_offsets(cl100k.encode(prompt, allowed_special="all")) == (
            prompt,
            offsets,
        )


def _offsets_reference(tok, tokens: list[int]) -> list[int]:
    """tiktoken's test oracle: a token's offset is the length of the common prefix of the
    text and the decoding of the tokens before it."""
    text = tok.decode(tokens, errors="strict")
    out = []
    for i in range(len(tokens)):
        prefix = tok.decode(tokens[:i], errors="ignore")
        n = 0
        while n < len(text) and n < len(prefix) and text[n] == prefix[n]:
            n += 1
        out.append(n)
    return out


@HYPOTHESIS
@given(data=st.data())
def test_hyp_offsets(cl100k, cl100k_reference, data):
    tokens = data.draw(st.lists(st.integers(0, 100_255), min_size=1, max_size=20))
    tokens = cl100k.encode(cl100k.decode(tokens, errors="ignore"), allowed_special="all")
    assert cl100k.decode_with_offsets(tokens)[1] == _offsets_reference(cl100k, tokens)
    assert cl100k.decode_with_offsets(tokens) == cl100k_reference.decode_with_offsets(tokens)


def test_unknown_ids_raise_an_error_naming_them(cl100k, cl100k_reference):
    for call in (cl100k.decode, cl100k.decode_batch, cl100k.decode_with_offsets):
        arg = [[10**9]] if call == cl100k.decode_batch else [10**9]
        with pytest.raises(ValueError, match=r"token id 1000000000 is not in this vocabulary"):
            call(arg)
    with pytest.raises(KeyError):  # what tiktoken raises, so its callers' handlers still work
        cl100k.decode_single_token_bytes(10**9)
    with pytest.raises(KeyError):
        cl100k_reference.decode_single_token_bytes(10**9)
    with pytest.raises(UnknownTokenError, match="'hello world' is not a single token"):
        cl100k.encode_single_token("hello world")
