"""``make data``: prepared shards decode back to every source document, in order, each with its
end-of-document id; re-runs are no-ops until an input, the tokenizer or an option changes; a
truncated or corrupted shard is refused, by name, before a data module exists.

Oracles: the corpus is written by the test with the standard library and pyarrow (documents
known before any llmlab code runs); text files are read as HF ``datasets`` documents it (UTF-8,
universal newlines); BPE ids come from HF ``tokenizers`` itself, which trained the tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from llmlab.train.documents import in_validation
from llmlab.train.prepare import main, prepare
from llmlab.train.shards import DatasetError, TokenStore, read_manifest
from llmlab.train.tokens import TokenDataModule

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "ünïcödé", "漢字",
         "🙂", "tab\there"]  # fmt: skip


def make_documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 60)))
        docs.append(f"doc {seed}-{i}: " + " ".join(words) + ("\n" if i % 3 else ""))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], list[str]]:
    """Text files (one document each), a JSONL and a Parquet file; the globs and, in input
    order, the documents as HF datasets reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    texts = make_documents(6, seed=1)
    texts[2] = "Windows line ends\r\nbecome \\n, as HF's text reader documents\r\n"
    (root / "texts").mkdir()
    for i, t in enumerate(texts):
        (root / "texts" / f"{i:02d}.txt").write_bytes(t.encode("utf-8"))
    rows = make_documents(40, seed=2)
    rows[5] = ""  # an empty document still gets its end-of-document id
    with open(root / "rows.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(rows):
            f.write(json.dumps({"id": i, "content": t}, ensure_ascii=False) + "\n")
    table_docs = make_documents(30, seed=3)
    pq.write_table(pa.table({"content": table_docs, "n": list(range(30))}), root / "t.parquet")
    globs = [str(root / "texts" / "*.txt"), str(root / "rows.jsonl"), str(root / "t.parquet")]
    as_read = [t.replace("\r\n", "\n") for t in texts] + rows + table_docs
    return globs, as_read


def split_documents(docs: list[str], fraction: float) -> dict[str, list[str]]:
    held = [in_validation(d.encode("utf-8"), fraction) for d in docs]
    return {
        "train": [d for d, h in zip(docs, held) if not h],
        "validation": [d for d, h in zip(docs, held) if h],
    }


def stored_documents(root: Path, split: str) -> list[np.ndarray]:
    store = TokenStore(root, read_manifest(root), split)
    return [store.document(d) for d in range(store.documents)]


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    globs, _ = corpus
    out = tmp_path_factory.mktemp("prepared") / "bytes"
    # 97-token shards: documents and windows run across many shard boundaries
    prepare(globs, out, text_field="content", shard_tokens=97, val_fraction=0.2, progress=False)
    return out


def test_bytes_shards_decode_to_every_document_in_order_with_its_end_token(corpus, prepared):
    _, docs = corpus
    manifest = read_manifest(prepared)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["eos_token_id"] == 256
    expected = split_documents(docs, 0.2)
    assert expected["validation"] and expected["train"]  # the split holds whole documents
    for split, want in expected.items():
        got = stored_documents(prepared, split)
        assert len(got) == len(want)
        for ids, text in zip(got, want):
            assert ids[-1] == 256 and 256 not in ids[:-1]
            assert bytes(ids[:-1].astype(np.uint8)) == text.encode("utf-8")
        shards = manifest["splits"][split]["shards"]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        sizes = sum((prepared / s["file"]).stat().st_size for s in shards)
        assert sizes == 2 * sum(len(t.encode("utf-8")) + 1 for t in want)


def test_parallel_workers_write_the_same_shards(corpus, prepared, tmp_path):
    globs, _ = corpus
    out = tmp_path / "two"
    prepare(globs, out, text_field="content", shard_tokens=97, val_fraction=0.2, num_proc=2,
            progress=False)  # fmt: skip
    one, two = read_manifest(prepared), read_manifest(out)
    assert one["splits"] == two["splits"]  # every shard's and index's sha256 included


def test_a_tokenizer_file_gives_hf_tokenizers_ids(corpus, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    globs, docs = corpus
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(docs, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "bpe"
    prepare(globs, out, tokenizer=str(tmp_path / "tokenizer.json"), text_field="content",
            shard_tokens=64, val_fraction=0.2, progress=False)  # fmt: skip
    eos = hf.token_to_id("<|endoftext|>")
    assert read_manifest(out)["tokenizer"]["eos_token_id"] == eos
    for split, want in split_documents(docs, 0.2).items():
        got = stored_documents(out, split)
        assert [list(ids) for ids in got] == [[*hf.encode(t).ids, eos] for t in want]
    assert (out / "tokenizer.json").is_file()  # the tokenizer travels with its shards
    # an end-of-document id that ordinary text also encodes to (WordPiece's [UNK], for a
    # character it never saw) would split documents where none end: refused, naming --eos
    from llmlab.tokenizer import WordPieceTokenizer, save

    save(WordPieceTokenizer.train(["plain ascii words only"], 60), tmp_path / "wp.json")
    with pytest.raises(ValueError, match=r"end-of-document id .* inside it; choose another --eos"):
        prepare(globs, tmp_path / "bad", tokenizer=str(tmp_path / "wp.json"), eos="[UNK]",
                text_field="content", val_fraction=0.2, progress=False)  # fmt: skip


def test_a_rerun_does_nothing_until_an_input_or_the_tokenizer_changes(corpus, prepared, tmp_path):
    globs, _ = corpus
    root = tmp_path / "copy"
    shutil.copytree(Path(globs[0]).parent.parent, root)
    mine = [str(root / "texts" / "*.txt"), str(root / "rows.jsonl"), str(root / "t.parquet")]
    out = tmp_path / "out"
    kw = dict(text_field="content", shard_tokens=97, val_fraction=0.2, progress=False)
    assert prepare(mine, out, **kw).built
    files = sorted(out.rglob("*.bin")) + sorted(out.rglob("*.npy"))  # (the manifest may move)
    stamps = [p.stat().st_mtime_ns for p in files]
    assert not prepare(mine, out, **kw).built  # nothing to do
    first = root / "texts" / "00.txt"
    os.utime(first, ns=(1, 1))  # touched, same contents: still up to date
    assert not prepare(mine, out, **kw).built
    assert [p.stat().st_mtime_ns for p in files] == stamps
    first.write_bytes(first.read_bytes().replace(b"doc", b"DOC"))  # same size, new text
    result = prepare(mine, out, **kw)
    assert result.built and result.reasons == [f"input changed: {first} (contents)"]
    result = prepare(mine, out, **{**kw, "shard_tokens": 50})
    assert result.reasons == ["shard_tokens changed (97 -> 50)"]
    (root / "extra.jsonl").write_text(json.dumps({"content": "new"}) + "\n")
    result = prepare([*mine, str(root / "extra.jsonl")], out, **{**kw, "shard_tokens": 50})
    assert result.reasons == [f"input added: {root / 'extra.jsonl'}"]
    tok = tmp_path / "tok.json"
    from llmlab.tokenizer import BPETokenizer, save

    other = BPETokenizer.train(["some text to learn from"], 260, special_tokens=["<|endoftext|>"])
    save(other, tok)
    result = prepare(mine, out, **{**kw, "shard_tokens": 50}, tokenizer=str(tok))
    assert len(result.reasons) == 2 and result.reasons[0].startswith("tokenizer changed")


def damaged_copy(prepared: Path, tmp_path: Path, damage) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(prepared, out)
    damage(out / "train" / "shard_00001.bin")
    return out


def test_a_truncated_shard_is_named_before_training(prepared, tmp_path):
    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:-2])

    out = damaged_copy(prepared, tmp_path, truncate)
    with pytest.raises(DatasetError, match=r"train/shard_00001\.bin is truncated: 192 bytes"):
        TokenDataModule(str(out), block_size=8, batch_size=2, verify_checksums=False)


def test_a_corrupted_shard_is_named_before_training(prepared, tmp_path):
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[10] ^= 0x01
        path.write_bytes(bytes(data))

    out = damaged_copy(prepared, tmp_path, flip)
    with pytest.raises(DatasetError, match=r"train/shard_00001\.bin is corrupted"):
        TokenDataModule(str(out), block_size=8, batch_size=2)
    (out / "manifest.json").unlink()
    with pytest.raises(DatasetError, match=r"not a prepared token dataset \(no manifest.json\)"):
        TokenDataModule(str(out), block_size=8, batch_size=2)


def test_the_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "none*.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("error: --input") and not (tmp_path / "o").exists()
    (tmp_path / "a.csv").write_text("x\n")
    assert main(["--input", str(tmp_path / "a.csv"), "--output", str(tmp_path / "o")]) == 2
    assert "a.csv is not a file type" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("one document\n")
    args = ["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o"), "--no-progress"]
    assert main(args) == 2  # one document cannot fill both splits
    assert "no document went to the" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # a failed build leaves nothing behind


def test_an_hf_dataset_folder_is_prepared_and_its_fingerprint_tracked(tmp_path, monkeypatch):
    """``--dataset`` takes what ``datasets.load_dataset`` takes (a hub name online; here a local
    folder, offline); re-running is a no-op while the dataset's fingerprint stays the same."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = tmp_path / "hf"
    (folder / "data").mkdir(parents=True)
    docs = make_documents(30, seed=4)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in docs]
    (folder / "data" / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    kw = dict(dataset=str(folder), val_fraction=0.3, progress=False)
    assert prepare(**kw, output=out).built
    got = stored_documents(out, "train") + stored_documents(out, "validation")
    assert sorted(bytes(d[:-1].astype(np.uint8)).decode() for d in got) == sorted(docs)
    assert not prepare(**kw, output=out).built
