"""tiktoken's special-token rules hold for all three models (one loop, in ``TokenizerBase``).

Oracle for BPE: tiktoken's own ``Encoding`` on the same ranks; for WordPiece and Unigram the rule
itself: allowed special text becomes its id, the text between is ``encode_ordinary``'s, and
disallowed special text raises before anything is encoded.
"""

from __future__ import annotations

import pytest
import tiktoken

from llmlab.tokenizer import BPETokenizer, UnigramTokenizer, WordPieceTokenizer


def _bpe() -> BPETokenizer:
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    return BPETokenizer(
        ranks, special_tokens={"<|endoftext|>": 257, "<|pad|>": 258}, backend="reference"
    )


def _wordpiece() -> WordPieceTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "ab", "##ab", "a", "##b", "b", "x"]
    return WordPieceTokenizer(vocab)


def _unigram() -> UnigramTokenizer:
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("▁ab", -1.0), ("▁", -2.0)]
    pieces += [("a", -3.0), ("b", -3.0), ("x", -3.0)]
    return UnigramTokenizer(pieces, control_ids=[1, 2])


CASES = {
    "bpe": (_bpe, "<|endoftext|>", "<|pad|>"),
    "wordpiece": (_wordpiece, "[SEP]", "[MASK]"),
    "unigram": (_unigram, "</s>", "<s>"),
}


@pytest.mark.parametrize("model", CASES)
def test_allowed_special_text_becomes_its_id(model):
    build, special, other = CASES[model]
    tok = build()
    ids = tok.encode(f"ab x{special}abx", allowed_special={special})
    expected = [
        *tok.encode_ordinary("ab x"),
        tok.special_tokens[special],
        *tok.encode_ordinary("abx"),
    ]
    assert ids == expected
    assert tok.encode(special + other, allowed_special="all") == [
        tok.special_tokens[special],
        tok.special_tokens[other],
    ]


@pytest.mark.parametrize("model", CASES)
def test_disallowed_special_text_raises_and_names_it(model):
    build, special, other = CASES[model]
    tok = build()
    with pytest.raises(ValueError, match="disallowed special token"):
        tok.encode(f"ab{special}")
    with pytest.raises(ValueError, match=other.replace("[", r"\[").replace("|", r"\|")):
        tok.encode(f"ab{other}", allowed_special={special})
    assert tok.encode(f"ab{special}", disallowed_special=()) == tok.encode_ordinary(f"ab{special}")
    assert tok.encode_batch(["ab", "x"]) == [tok.encode("ab"), tok.encode("x")]


def test_unknown_special_token_name_fails_clearly():
    for build, _, _ in CASES.values():
        with pytest.raises(ValueError, match="unknown special token"):
            build().encode("ab", allowed_special={"<nope>"})


def test_bpe_reference_follows_tiktoken():
    tok = _bpe()
    enc = tiktoken.Encoding(
        "special-test",
        pat_str=tok.pattern,
        mergeable_ranks=tok.ranks,
        special_tokens=tok.special_tokens,
    )
    text = "ab<|endoftext|>a b<|pad|>ab"
    for allowed in ({"<|endoftext|>"}, "all"):
        assert tok.encode(text, allowed_special=allowed, disallowed_special=()) == enc.encode(
            text, allowed_special=allowed, disallowed_special=()
        )


def test_wordpiece_wraps_in_cls_sep_on_request():
    tok = _wordpiece()
    assert tok.encode("ab", add_special_tokens=True) == [2, 5, 3]
