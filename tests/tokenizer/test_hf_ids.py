"""``tokenizer.json`` ids that no model could use are refused on loading, in one line naming the
file, the token and the id: negative, non-integer or beyond int32 ids, two tokens on one id, an
added token whose id contradicts the vocabulary, and ids so sparse that most rows of the
embedding they imply belong to no token. Before, such files loaded silently (a negative id
indexes the embedding from its end; an id of 10^12 made ``vocab_size`` 10^12 + 1)."""

from __future__ import annotations

import copy
import json

import pytest

from llmlab.tokenizer import BPETokenizer, TokenizerFileError, WordPieceTokenizer, load, save


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A byte-level BPE and a WordPiece ``tokenizer.json``, each with one special token."""
    root = tmp_path_factory.mktemp("tok")
    text = ["to be or not to be, that is the question " * 20]
    bpe = BPETokenizer.train(text, vocab_size=270, special_tokens=["<|endoftext|>"])
    wp = WordPieceTokenizer.train(text, vocab_size=60)
    return {
        "bpe": json.loads(save(bpe, root / "bpe.json", format="hf").read_text()),
        "wordpiece": json.loads(save(wp, root / "wp.json", format="hf").read_text()),
    }


def _vocab_token(data, index=5):
    return list(data["model"]["vocab"])[index]


def _set_vocab_id(value):
    def change(data):
        data["model"]["vocab"][_vocab_token(data)] = value

    return change


def _set_added_id(value):
    def change(data):
        data["added_tokens"][0]["id"] = value

    return change


def _add_token(content, value):
    def change(data):
        entry = dict(data["added_tokens"][0], content=content, id=value)
        data["added_tokens"].append(entry)

    return change


CASES = {
    "negative": (_set_vocab_id(-1), "has id -1: ids must be integers in 0..2147483647"),
    "float": (_set_vocab_id(5.5), "has id 5.5: ids must be integers"),
    "beyond int32": (_set_vocab_id(10**12), "has id 1000000000000: ids must be integers"),
    "duplicate": (_set_vocab_id(7), "share id 7"),
    "sparse": (_set_vocab_id(100_000), "has id 100000, but there are only"),
    "added negative": (_set_added_id(-3), "added_tokens token "),
    "added contradicts the vocab": (_set_added_id(1), "but the vocabulary gives it id 0"),
    "added on a vocab id": (_add_token("<|new|>", 1), "share id 1"),
}


@pytest.mark.parametrize("family", ["bpe", "wordpiece"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_ids_are_refused_naming_the_file_and_the_id(family, case, files, tmp_path):
    change, message = CASES[case]
    data = copy.deepcopy(files[family])
    change(data)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerFileError) as err:
        load(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


@pytest.mark.parametrize("family", ["bpe", "wordpiece"])
def test_the_unchanged_files_load(family, files, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(files[family]), encoding="utf-8")
    assert load(path).encode("to be") != []
