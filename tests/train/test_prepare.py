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


# ------------------------------------------------------------ ordinary inputs (issue 41)
def decoded(root: Path) -> dict[str, list[str]]:
    """Each split's stored documents as text (byte ids), in order."""
    return {
        split: [bytes(d[:-1].astype(np.uint8)).decode("utf-8") for d in stored_documents(root, s)]
        for split, s in (("train", "train"), ("validation", "validation"))
    }


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """``main(args)``: its status and its stderr. A traceback would fail the test instead."""
    status = main([*args, "--no-progress"])
    return status, capsys.readouterr().err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_single_text_file_is_split_by_the_text_unit_its_error_names(tmp_path, capsys):
    paras = make_documents(24, seed=5)
    paras = [p.strip("\n") or "x" for p in paras]  # paragraphs: text between blank lines
    single = tmp_path / "book.txt"
    single.write_text("\n\n".join(paras), encoding="utf-8")
    out = tmp_path / "out"
    status, err = run_cli(capsys, "--input", str(single), "--output", str(out))
    line = error_line(err)  # one document cannot fill two splits: a finer unit, not a fraction
    assert status == 2 and "1 document(s)" in line and "--text-unit paragraph" in line
    assert "raise --val-fraction" not in line and not out.exists()
    status, err = run_cli(capsys, "--input", str(single), "--output", str(out),
                          "--text-unit", "paragraph", "--val-fraction", "0.2")  # fmt: skip
    assert status == 0, err
    assert decoded(out) == split_documents(paras, 0.2)


def test_a_folder_is_every_readable_file_under_it_in_path_order(tmp_path, caplog):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    docs = make_documents(12, seed=6)
    for i, doc in enumerate(docs):
        where = folder / "sub" if i % 2 else folder
        (where / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    (folder / "notes.csv").write_text("a,b\n")  # another type: named in a warning, not read
    (folder / ".hidden.txt").write_text("never read\n")
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="llmlab.train.prepare"):
        prepare([str(folder)], out, val_fraction=0.3, progress=False)
    order = sorted(range(12), key=lambda i: ("sub/" if i % 2 else "") + f"{i:02d}.txt")
    assert decoded(out) == split_documents([docs[i] for i in order], 0.3)
    assert "skipped 1 file(s) of other types: notes.csv" in caplog.text
    with pytest.raises(ValueError, match=r"folder holds no file HF datasets reads here"):
        (tmp_path / "empty").mkdir()
        prepare([str(tmp_path / "empty")], tmp_path / "o2", progress=False)


BAD_JSONL = [
    json.dumps({"body": "first good record"}),
    "{not json",
    json.dumps({"title": "no body field"}),
    "",  # blank lines are not records
    json.dumps({"body": None}),
    json.dumps({"body": 7}),
    json.dumps(["not", "an", "object"]),
    json.dumps({"body": "second good record"}),
]


def test_bad_jsonl_records_are_skipped_named_and_counted_or_refused_with_strict(
    tmp_path, caplog, capsys
):
    good = [f"good record {i}: " + " ".join(WORDS[: i % 9 + 1]) for i in range(30)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join(BAD_JSONL + [json.dumps({"body": t}) for t in good]) + "\n", encoding="utf-8"
    )
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="llmlab.train.prepare"):
        result = prepare([str(rows)], out, text_field="body", val_fraction=0.3, progress=False)
    kept = ["first good record", "second good record", *good]
    assert decoded(out) == split_documents(kept, 0.3)
    warnings = [r.getMessage() for r in caplog.records]
    for where, what in [(2, "not JSON"), (3, "no 'body' field"), (5, "'body' is null"),
                        (6, "'body' is int, not a string"), (7, "not a JSON object")]:  # fmt: skip
        assert any(f"{rows} line {where}: {what}" in w for w in warnings), (where, warnings)
    summary = [w for w in warnings if "skipped 5 bad record(s) of 37" in w]
    assert len(summary) == 1 and f"{rows} (5)" in summary[0], warnings
    assert result.manifest["skipped_records"] == 5
    # --strict: the first bad record, by file and line, in one line; the dataset is kept
    status, err = run_cli(capsys, "--input", str(rows), "--output", str(out),
                          "--text-field", "body", "--val-fraction", "0.3", "--strict")  # fmt: skip
    line = error_line(err)
    assert status == 2 and f"{rows} line 2: not JSON" in line and "--strict" in line
    assert read_manifest(out)["skipped_records"] == 5  # the old dataset is untouched
    # a file none of whose records has the field: a wrong --text-field, named with the fields
    status, err = run_cli(capsys, "--input", str(rows), "--output", str(tmp_path / "o2"))
    line = error_line(err)
    assert status == 2 and f"{rows}: none of its 37 records has a usable 'text' text" in line
    assert "line 1: no 'text' field" in line and "['body']" in line and "--text-field" in line
    assert not (tmp_path / "o2").exists()


def test_parquet_null_texts_are_skipped_and_a_bad_column_is_named(tmp_path, caplog, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_documents(20, seed=7)
    column = [None if i in (3, 11) else t for i, t in enumerate(texts)]
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": column, "n": list(range(20))}), table)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="llmlab.train.prepare"):
        prepare([str(table)], out, text_field="content", val_fraction=0.3, progress=False)
    kept = [t for t in column if t is not None]
    assert decoded(out) == split_documents(kept, 0.3)
    assert f"{table} row 3: 'content' is null" in caplog.text
    assert f"{table} row 11: 'content' is null" in caplog.text
    assert "skipped 2 bad record(s) of 20" in caplog.text
    status, err = run_cli(capsys, "--input", str(table), "--output", str(tmp_path / "o"),
                          "--text-field", "n")  # fmt: skip
    line = error_line(err)
    assert status == 2 and f"{table}: column 'n' holds int64, not text" in line
    assert "text columns: ['content']" in line
    status, err = run_cli(capsys, "--input", str(table), "--output", str(tmp_path / "o"))
    assert status == 2 and f"{table} has no column 'text'" in error_line(err)
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"this is not parquet at all\n")
    status, err = run_cli(capsys, "--input", str(fake), "--output", str(tmp_path / "o"))
    assert status == 2 and f"{fake} is not a Parquet file" in error_line(err)
    assert not (tmp_path / "o").exists()


def test_empty_and_binary_files_are_refused_in_one_line_naming_file_and_line(tmp_path, capsys):
    out = tmp_path / "out"
    for name in ("empty.txt", "empty.jsonl", "empty.parquet"):
        (tmp_path / name).write_bytes(b"")
        status, err = run_cli(capsys, "--input", str(tmp_path / name), "--output", str(out))
        assert status == 2 and f"{tmp_path / name} is empty (0 bytes)" in error_line(err)
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"looks like text\nfor two lines\n\x89PNG\r\n\x1a\n\x00\x00")
    status, err = run_cli(capsys, "--input", str(binary), "--output", str(out))
    line = error_line(err)
    assert status == 2 and f"{binary}: not UTF-8 text (byte 0x89 at offset 30, line 3)" in line
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"ascii\n\x00\x01\x02")
    status, err = run_cli(capsys, "--input", str(nul), "--output", str(out))
    assert status == 2 and f"{nul}: a NUL byte at offset 6 (line 2)" in error_line(err)
    jsonl = tmp_path / "blob.jsonl"
    jsonl.write_bytes(b"\xff\xfe\x00\x01\n\xc3\x28\n")
    status, err = run_cli(capsys, "--input", str(jsonl), "--output", str(out))
    line = error_line(err)
    assert status == 2 and f"{jsonl}: none of its 2 records" in line
    assert "line 1: not UTF-8 text" in line
    # a multi-byte character cut across the 1 MiB read boundary is text, not binary
    edge = tmp_path / "edge.txt"
    edge.write_bytes(b"a" * (2**20 - 1) + "é".encode() + b"\n" + b"b" * 10)
    from llmlab.train.documents import check_inputs

    check_inputs([edge])
    assert not out.exists()


def test_the_val_fraction_advice_builds_when_followed(tmp_path, capsys):
    """Each split's "use --val-fraction X" names a value that fills both splits."""
    import re

    docs = [f"document number {i}\n" for i in range(5)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    for bad, split in (("0.0001", "validation"), ("0.9999", "train")):
        out = tmp_path / f"out-{split}"
        status, err = run_cli(capsys, "--input", str(rows), "--output", str(out),
                              "--val-fraction", bad)  # fmt: skip
        line = error_line(err)
        assert status == 2 and f"no document went to the {split} split (5 document(s)" in line
        (value,) = re.findall(r"use --val-fraction ([0-9.e-]+),", line)
        status, err = run_cli(capsys, "--input", str(rows), "--output", str(out),
                              "--val-fraction", value)  # fmt: skip
        assert status == 0, err
        assert decoded(out) == split_documents(docs, float(value))
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"text": "twin"}) + "\n" + json.dumps({"text": "twin"}) + "\n")
    status, err = run_cli(capsys, "--input", str(same), "--output", str(tmp_path / "o"))
    assert status == 2 and "all 2 documents are the same text" in error_line(err)
    assert "use --val-fraction" not in err  # no fraction can split identical documents


def test_clean_and_dirty_jsonl_read_the_same_documents(tmp_path):
    """A clean file goes through HF's ``json`` builder; one bad line sends the file through the
    line-by-line reader instead. Both give the same documents (escapes, line and paragraph
    separators inside strings, non-ASCII), in order."""
    docs = make_documents(20, seed=8)
    docs[4] = 'crlf\r\ninside, a line separator \u2028 and \\ escapes "quoted" \u00e9\U0001f642'
    lines = [json.dumps({"id": i, "text": d}, ensure_ascii=i % 2 == 1) for i, d in enumerate(docs)]
    clean, dirty = tmp_path / "clean.jsonl", tmp_path / "dirty.jsonl"
    clean.write_text("\n".join(lines) + "\n", encoding="utf-8")
    dirty.write_text("\n".join([*lines[:10], "{bad", *lines[10:]]) + "\n", encoding="utf-8")
    kw = dict(val_fraction=0.3, progress=False)
    assert prepare([str(clean)], tmp_path / "a", **kw).manifest["skipped_records"] == 0
    assert prepare([str(dirty)], tmp_path / "b", **kw).manifest["skipped_records"] == 1
    assert decoded(tmp_path / "a") == decoded(tmp_path / "b") == split_documents(docs, 0.3)


def test_a_train_split_shorter_than_one_window_says_what_helps(prepared):
    tokens = read_manifest(prepared)["splits"]["train"]["tokens"]
    with pytest.raises(DatasetError, match=rf"has {tokens} tokens, fewer than one window of "
                       rf"block_size \+ 1 = {tokens + 1}: prepare more text, or lower "
                       r"model\.block_size"):  # fmt: skip
        TokenDataModule(str(prepared), block_size=tokens, batch_size=1, verify_checksums=False)
