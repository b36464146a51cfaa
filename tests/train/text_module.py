"""A byte-level ``TextDataModule`` over a small two-script text, set up for fitting.

Shared by ``test_data.py`` (packing and sharding) and ``test_resume_data_order.py`` (which batch
each step sees across a resume).
"""

from __future__ import annotations

from llmlab.train.data import ByteTokenizer, TextDataModule

TEXT = (
    "ROMEO. But soft, what light through yonder window breaks?\n"
    "It is the east, and Juliet is the sun — ünïcödé and 漢字 too.\n"
) * 40


def make_module(tmp_path, block_size=16, batch_size=4):
    train = tmp_path / "train.txt"
    val = tmp_path / "val.txt"
    train.write_text(TEXT, encoding="utf-8")
    val.write_text(TEXT[:500], encoding="utf-8")
    dm = TextDataModule(
        ByteTokenizer(),
        block_size=block_size,
        batch_size=batch_size,
        files={"train": [str(train)], "validation": [str(val)]},
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    return dm
