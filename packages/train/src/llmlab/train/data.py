"""Text data: a corpus that ships with the install, tokenized with HF ``datasets`` and packed.

The pipeline is the standard one: ``load_dataset("text", ...)`` (or any dataset name when
online) → ``.map(tokenize)`` → pack the token stream into fixed-length blocks of
``block_size + 1`` tokens (inputs and next-token targets) → Arrow files cached under the cache
dir, keyed by the tokenizer, the files and the block size, so a second run starts at once.

Batches are sharded by data-parallel rank here rather than by Lightning's injected sampler, by
the rule of :mod:`llmlab.train.global_batch`: a parallel run sees exactly the global batches a
single process would.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from llmlab.tokenizer import ByteTokenizer  # checkpoints and byte.yaml name it from here
from llmlab.train.corpora import CORPORA, corpus_files
from llmlab.train.global_batch import GlobalBatchDataModule

__all__ = ["CORPORA", "ByteTokenizer", "TextDataModule", "corpus_files", "pack_blocks"]


class Tokenizer(Protocol):
    """What the data module needs of a tokenizer (the BPE, WordPiece and Unigram ones fit)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable key for cache files: the tokenizer's own fingerprint, or a hash of its pickle."""
    own = getattr(tokenizer, "fingerprint", None)
    if isinstance(own, str):
        return own
    return hashlib.sha1(pickle.dumps(tokenizer)).hexdigest()[:16]


def pack_blocks(ids: Sequence[int], block_size: int) -> list[list[int]]:
    """Non-overlapping blocks of ``block_size + 1`` tokens; the incomplete tail is dropped."""
    n = block_size + 1
    return [list(ids[i : i + n]) for i in range(0, len(ids) - n + 1, n)]


class TextDataModule(GlobalBatchDataModule):
    """Packed next-token blocks from a text corpus, sharded by data-parallel rank.

    ``batch_size`` is the *global* batch: each of the ``R`` data-parallel replicas loads
    ``batch_size / R`` blocks per step, so results do not depend on the number of processes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        block_size: int = 128,
        batch_size: int = 32,
        corpus: str = "shakespeare",
        files: dict[str, list[str]] | None = None,
        dataset_name: str | None = None,
        cache_dir: str = ".cache/llmlab",
        seed: int = 1337,
        num_proc: int = 1,
    ) -> None:
        super().__init__(batch_size, seed)
        if block_size < 1 or batch_size < 1:
            raise ValueError(
                f"block_size and batch_size must be positive, got {block_size} and {batch_size}"
            )
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.corpus = corpus
        self.files = files
        self.dataset_name = dataset_name
        self.cache_dir = Path(cache_dir)
        self.num_proc = num_proc
        self.splits: dict[str, Any] = {}

    # ------------------------------------------------------------------ loading
    def _raw_datasets(self) -> Any:
        import datasets

        hf_cache = str(self.cache_dir / "hf")
        if self.dataset_name:  # any hub dataset with a "text" column (needs network once)
            return datasets.load_dataset(self.dataset_name, cache_dir=hf_cache)
        files = self.files or corpus_files(self.corpus)
        missing = [f for split in files.values() for f in split if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"data files not found: {missing[:3]}")
        return datasets.load_dataset(
            "text", data_files=files, keep_linebreaks=True, cache_dir=hf_cache
        )

    def _fingerprint(self, split: str, raw: Any) -> str:
        key = json.dumps(
            {
                "v": 1,
                "split": split,
                "source": raw[split]._fingerprint,
                "tokenizer": tokenizer_fingerprint(self.tokenizer),
                "block_size": self.block_size,
            },
            sort_keys=True,
        )
        return hashlib.sha1(key.encode()).hexdigest()[:16]

    def prepare_data(self) -> None:
        self._build()  # rank zero builds the Arrow cache; the others then read it

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.splits = self._build()

    def _build(self) -> dict[str, Any]:
        raw = self._raw_datasets()
        tokenizer, block_size = self.tokenizer, self.block_size
        splits = {}
        for split in ("train", "validation"):
            if split not in raw:
                raise ValueError(f"the dataset has no {split!r} split; it has {list(raw)}")
            fp = self._fingerprint(split, raw)
            ids = raw[split].map(
                lambda batch: {"ids": [tokenizer.encode(t) for t in batch["text"]]},
                batched=True,
                remove_columns=raw[split].column_names,
                new_fingerprint=f"tok-{fp}",
                num_proc=self.num_proc if self.num_proc > 1 else None,
                desc=f"tokenizing {split}",
            )
            # One batch = the whole split, so only the stream's final tail is dropped and the
            # blocks, decoded in order, are exactly the source text.
            blocks = ids.map(
                lambda batch: {
                    "block": pack_blocks([t for seq in batch["ids"] for t in seq], block_size)
                },
                batched=True,
                batch_size=None,
                remove_columns=["ids"],
                new_fingerprint=f"pack-{fp}",
                desc=f"packing {split}",
            )
            if len(blocks) == 0:
                raise ValueError(
                    f"the {split} split is shorter than one block of {block_size + 1} tokens"
                )
            splits[split] = blocks.with_format("torch")
        return splits

    # ------------------------------------------------------------------ loaders
    def split_dataset(self, split: str) -> Any:
        return self.splits[split]

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return collate_blocks(rows)


def collate_blocks(rows: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack blocks of ``T + 1`` tokens into (inputs, next-token targets), each (B, T)."""
    blocks = torch.stack([row["block"] for row in rows]).long()
    return blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous()
