"""The data module: packed blocks are exactly the source text; sharding keeps global batches."""

from __future__ import annotations

import torch

from llmlab.train.data import ByteTokenizer, corpus_files
from tests.train.text_module import TEXT, make_module


def test_blocks_decoded_in_order_reproduce_the_source_text(tmp_path):
    dm = make_module(tmp_path)
    blocks = dm.splits["train"][:]["block"]
    assert blocks.shape[1] == 17
    decoded = ByteTokenizer().decode_bytes(blocks.flatten().tolist()).decode("utf-8", "replace")
    raw = TEXT.encode("utf-8")
    n = len(raw) // 17 * 17
    assert decoded == raw[:n].decode("utf-8", "replace")


def test_inputs_and_targets_are_shifted_by_one(tmp_path):
    dm = make_module(tmp_path)
    inputs, targets = next(iter(dm.loader("train")))
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_two_replicas_see_exactly_the_single_process_global_batch(tmp_path):
    dm = make_module(tmp_path, batch_size=8)
    single = next(iter(dm.loader("train")))[0]
    halves = [next(iter(dm.loader("train", replicas=2, rank=r)))[0] for r in range(2)]
    rows = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert rows(torch.cat(halves)) == rows(single)


def test_batch_not_divisible_by_replicas_is_refused(tmp_path):
    dm = make_module(tmp_path, batch_size=6)
    try:
        dm.loader("train", replicas=4)
    except ValueError as err:
        assert "data.batch_size=6" in str(err) and "multiple of 4" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_the_shipped_corpus_holds_out_whole_works():
    files = corpus_files("shakespeare")
    assert len(files["train"]) > 60 and 3 <= len(files["validation"]) <= 6
    assert not set(files["train"]) & set(files["validation"])
