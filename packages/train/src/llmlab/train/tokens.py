"""``data=tokens``: training windows read from prepared shards (``make data``), memory-mapped.

A split's token stream (all its shards end to end) is cut into windows of ``T + 1`` tokens at
stride ``T``, as nanoGPT samples them: window ``w`` is tokens ``[wT, wT + T + 1)``, inputs its
first ``T``, targets its last ``T``, so every token but the first is a target once per pass.
Windows run across document (and shard) boundaries: nothing is padded or dropped.

* **Order**: the training stream is a :class:`~llmlab.train.mixture.MixtureSchedule` over the
  sources (one source: all of it); each source hands out its windows in a seeded permutation,
  a fresh one per pass. Global batches and their split over data-parallel replicas follow
  :mod:`llmlab.train.global_batch`, so any layout sees the batches of one process, and the
  checkpointed position resumes at any data-parallel degree.
* **Documents**: with ``document_mask=true`` a batch is ``(inputs, targets, document_ids)``;
  the ids (counted from the end-of-document tokens) restart at 0 in each row; the model attends
  within each document only, with positions restarting at each document's first token. With
  ``eod_mask_loss=true`` the target after each end-of-document token is not counted.
* **Memory**: nothing is loaded whole, and nothing grows with the corpus. Windows are copied
  out of the shards' memory maps, whose pages are then released; the order of the windows is
  computed from the position (:mod:`llmlab.train.mixture`), not stored.
* **Checks before training**: every shard and index against the manifest (sizes always,
  sha256 in the launching process unless ``verify_checksums=false``), the tokenizer against
  the one the shards were made with, and enough windows for a global batch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from llmlab.parallel.loss_mean import IGNORE_INDEX
from llmlab.train.global_batch import GlobalBatchDataModule
from llmlab.train.mixture import MixtureProportions, MixtureSchedule, Shuffle, normalise_weights
from llmlab.train.resumable import ResumableSampler
from llmlab.train.shards import DatasetError, TokenStore, read_manifest, verify

log = logging.getLogger(__name__)


def source_dirs(dir: str | os.PathLike, mix: Mapping[str, Any] | None) -> dict[str, Path]:
    """``{name: prepared dataset}``: ``dir`` itself, or its subfolders named in ``mix``."""
    root = Path(dir)
    if not mix:
        return {root.name or "data": root}
    return {str(name): root / str(name) for name in mix}


def prepared_tokenizer(dir: str, mix: Mapping[str, Any] | None = None) -> Any:
    """The tokenizer the prepared dataset(s) at ``dir`` were made with (``tokenizer=prepared``):
    the byte tokenizer with its end-of-document id, or the copy of the tokenizer file."""
    entries = {
        name: read_manifest(path)["tokenizer"] for name, path in source_dirs(dir, mix).items()
    }
    (name, entry), *others = entries.items()
    for other, e in others:
        if e["fingerprint"] != entry["fingerprint"]:
            raise DatasetError(
                f"data.mix: {name} and {other} were prepared with different tokenizers "
                f"({entry['fingerprint']} vs {e['fingerprint']}); prepare them with the same one"
            )
    if entry["kind"] == "bytes":
        from llmlab.tokenizer import ByteTokenizer

        return ByteTokenizer(eos=True)
    from llmlab.tokenizer import load

    tokenizer = load(source_dirs(dir, mix)[name] / entry["file"])
    if tokenizer.fingerprint != entry["fingerprint"]:
        raise DatasetError(
            f"{source_dirs(dir, mix)[name] / entry['file']} is not the tokenizer the shards were "
            f"made with (fingerprint {tokenizer.fingerprint}, manifest {entry['fingerprint']})"
        )
    return tokenizer


class StreamSampler(ResumableSampler):
    """The stream's positions in order, epoch ``e`` being ``e·N ... (e+1)·N - 1``: the
    dataset orders windows itself, from the position (the rank split and resume are the
    parent's)."""

    def __iter__(self) -> Iterator[int]:
        offset = self.epoch * len(self.dataset)  # type: ignore[arg-type]
        return (offset + i for i in super().__iter__())


class TrainWindows(Dataset):
    """Global stream position -> (window tokens, document ids or None), in the order of the
    :class:`~llmlab.train.mixture.MixtureSchedule` and each source's :class:`Shuffle`."""

    def __init__(
        self,
        stores: list[TokenStore],
        schedule: MixtureSchedule,
        block_size: int,
        seed: int,
        docs: bool,
    ) -> None:
        self.stores, self.schedule, self.T = stores, schedule, block_size
        self.windows = [(s.tokens - 1) // block_size for s in stores]
        self.seed, self.docs = seed, docs
        self._shuffles: dict[tuple[int, int], Shuffle] = {}

    def __len__(self) -> int:
        """An epoch: as many windows as the sources hold together."""
        return sum(self.windows)

    def shuffle(self, source: int, epoch_pass: int) -> Shuffle:
        """Source ``source``'s window order on its ``epoch_pass``-th pass (seeded)."""
        key = (source, epoch_pass)
        if key not in self._shuffles:
            if len(self._shuffles) >= 4 * len(self.stores):  # a few passes per source are live
                self._shuffles.pop(next(iter(self._shuffles)))
            self._shuffles[key] = Shuffle(self.windows[source], [self.seed, source, epoch_pass])
        return self._shuffles[key]

    def windows_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window index in it) of each global position."""
        src, k = self.schedule.locate(np.asarray(positions, dtype=np.int64))
        window = np.empty_like(k)
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            epoch_pass, offset = np.divmod(k[rows], self.windows[s])
            for p in np.unique(epoch_pass).tolist():
                here = epoch_pass == p
                window[rows[here]] = self.shuffle(s, p)(offset[here])
        return src, window

    def window_of(self, position: int) -> tuple[int, int]:
        src, window = self.windows_of(np.array([position]))
        return int(src[0]), int(window[0])

    def __getitem__(self, position: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """A batch's windows at once (the ``DataLoader`` calls this with the sampler's indices)."""
        return read_windows(self.stores, *self.windows_of(np.asarray(positions)), self.T, self.docs)


class ValidationWindows(Dataset):
    """Every source's validation windows, source after source, in order."""

    def __init__(self, stores: list[TokenStore], block_size: int, docs: bool) -> None:
        self.stores, self.T, self.docs = stores, block_size, docs
        self.ends = np.cumsum([(s.tokens - 1) // block_size for s in stores])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        i = np.asarray(indices, dtype=np.int64)
        src = np.searchsorted(self.ends, i, side="right")
        window = i - np.concatenate([[0], self.ends])[src]
        return read_windows(self.stores, src, window, self.T, self.docs)


def read_windows(
    stores: list[TokenStore], src: np.ndarray, windows: np.ndarray, T: int, docs: bool
) -> list[tuple]:
    """(tokens, document ids or None) of window ``windows[i]`` of source ``src[i]``: tokens
    ``[wT, wT + T + 1)``, and the documents of its first ``T`` (the inputs)."""
    rows: list[Any] = [None] * len(windows)
    for s in np.unique(src).tolist():
        sel = np.flatnonzero(src == s)
        starts = windows[sel].astype(np.int64) * T
        tokens = stores[s].read_windows(starts, T + 1)
        ids = document_ids(tokens[:, :T], stores[s].eos_token_id) if docs else [None] * len(sel)
        for i, row in zip(sel.tolist(), zip(tokens, ids, strict=True), strict=True):
            rows[i] = row
    return rows


def document_ids(tokens: np.ndarray, eos_token_id: int) -> np.ndarray:
    """(B, T) the document of each token, from 0 at each row's start: a document ends with its
    end-of-document token, the only place that id occurs (``make data`` checks it), so the ids
    count the end tokens strictly before each position."""
    ends = tokens == eos_token_id
    return np.cumsum(ends, axis=1) - ends


def collate_windows(
    rows: list[tuple[np.ndarray, Any]], eod_mask_token: int | None = None
) -> tuple[torch.Tensor, ...]:
    """(inputs, targets) or (inputs, targets, document_ids), each (B, T) int64.
    ``eod_mask_token``: targets whose input is that token (the end of a document) are
    ``IGNORE_INDEX``: no loss on guessing the next document from the one that ended."""
    windows = torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64))
    batch = (windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
    if eod_mask_token is not None:
        batch[1][batch[0] == eod_mask_token] = IGNORE_INDEX
    if rows[0][1] is None:
        return batch
    return (*batch, torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.int64)))


def _has(trainer: Any, kind: type) -> bool:
    return any(isinstance(c, kind) for c in trainer.callbacks)


def _launching_process() -> bool:
    """True in the process a run starts from (local rank 0): it checks checksums once."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


class TokenDataModule(GlobalBatchDataModule):
    """Windows of prepared token shards (one dataset at ``dir``, or a mixture of the datasets
    in ``dir``'s subfolders named by ``mix``), global batches split by data-parallel rank."""

    def __init__(
        self,
        dir: str,
        mix: Mapping[str, float] | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        seed: int = 1337,
        document_mask: bool = False,
        verify_checksums: bool = True,
        tokenizer: Any = None,
        eod_mask_loss: bool = False,
    ) -> None:
        """``eod_mask_loss``: no loss on the target that follows an end-of-document token
        (Megatron's ``--eod-mask-loss``); ranks then hold unequal numbers of counted tokens,
        and ``train/loss`` is still the global batch's mean (:mod:`llmlab.parallel.loss_mean`)."""
        super().__init__(batch_size, seed)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"data.block_size must be a positive integer, got {block_size!r}")
        self.block_size, self.document_mask = block_size, bool(document_mask)
        self.eod_mask_loss = bool(eod_mask_loss)
        self.weights = normalise_weights(mix) if mix else None
        self.dirs = source_dirs(dir, mix)
        self.manifests = {n: read_manifest(p) for n, p in self.dirs.items()}
        for name, path in self.dirs.items():
            verify(path, self.manifests[name], checksums=verify_checksums and _launching_process())
        self.fingerprint = self._check_tokenizers(tokenizer)
        self._check_sizes()
        self.stores: dict[str, list[TokenStore]] = {}
        self.schedule: MixtureSchedule | None = None

    # ---------------------------------------------------------------------- checks
    def _check_tokenizers(self, tokenizer: Any) -> str:
        fingerprints = {n: m["tokenizer"]["fingerprint"] for n, m in self.manifests.items()}
        if len(set(fingerprints.values())) > 1:
            raise DatasetError(
                f"data.mix: the datasets were prepared with different tokenizers {fingerprints}; "
                "prepare them with the same one"
            )
        prepared = next(iter(fingerprints.values()))
        if tokenizer is not None:
            from llmlab.train.data import tokenizer_fingerprint

            ours = tokenizer_fingerprint(tokenizer)
            if ours != prepared:
                raise DatasetError(
                    f"data.dir={self.dirs[next(iter(self.dirs))]} was prepared with the tokenizer "
                    f"{prepared}, but this run's tokenizer is {type(tokenizer).__name__} ({ours}); "
                    "use tokenizer=prepared (the dataset's own) or prepare it with this tokenizer"
                )
        return prepared

    def _check_sizes(self) -> None:
        T, B = self.block_size, self.batch_size
        val_windows = 0
        for name, m in self.manifests.items():
            train = (m["splits"]["train"]["tokens"] - 1) // T
            if train < 1:
                raise DatasetError(
                    f"data source {name}: its train split has {m['splits']['train']['tokens']} "
                    f"tokens, fewer than one window of block_size + 1 = {T + 1}: prepare more "
                    "text, or lower model.block_size"
                )
            val_windows += (m["splits"]["validation"]["tokens"] - 1) // T
        if val_windows < B:
            raise DatasetError(
                f"the validation split holds {val_windows} windows of {T + 1} tokens, fewer "
                f"than one global batch of {B}: prepare with a larger --val-fraction, or lower "
                "data.batch_size or model.block_size"
            )

    # ---------------------------------------------------------------------- Lightning
    def setup(self, stage: str | None = None) -> None:
        if not self.stores:
            self._open()
        trainer = self.trainer
        if self.weights and trainer is not None and not _has(trainer, MixtureProportions):
            # the realised proportions go to the run's logger with every step
            assert self.schedule is not None
            callback = MixtureProportions(
                self.schedule, self.epoch_windows, self.batch_size, self._train_progress
            )
            trainer.callbacks.append(callback)

    def _open(self) -> None:
        for split in ("train", "validation"):
            self.stores[split] = [
                TokenStore(self.dirs[n], self.manifests[n], split) for n in self.dirs
            ]
        self.epoch_windows = sum((s.tokens - 1) // self.block_size for s in self.stores["train"])
        weights = list(self.weights.values()) if self.weights else [1.0]
        self.schedule = MixtureSchedule(list(self.dirs), weights)
        log.info(
            "tokens: %d train windows of %d tokens per epoch, from %s",
            self.epoch_windows,
            self.block_size + 1,
            self.schedule.describe(),
        )

    def split_dataset(self, split: str) -> Dataset:
        if not self.stores:
            self._open()
        if split == "train":
            assert self.schedule is not None
            return TrainWindows(
                self.stores["train"], self.schedule, self.block_size, self.seed, self.document_mask
            )
        return ValidationWindows(self.stores[split], self.block_size, self.document_mask)

    def collate(self, rows: list[tuple[np.ndarray, Any]]) -> tuple[torch.Tensor, ...]:
        manifest = next(iter(self.manifests.values()))  # one tokenizer (checked)
        eod = int(manifest["tokenizer"]["eos_token_id"]) if self.eod_mask_loss else None
        return collate_windows(rows, eod)

    def sampler(self, dataset: Dataset, split: str, replicas: int, rank: int) -> ResumableSampler:
        # The train dataset orders the stream itself; the sampler only adds the epoch's offset.
        cls = StreamSampler if split == "train" else ResumableSampler
        return cls(dataset, num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)

    def identity(self) -> dict[str, Any]:
        """The data, order and batch a checkpointed position refers to."""
        data = {
            name: hashlib.sha1(
                json.dumps(m["splits"]["train"], sort_keys=True).encode()
            ).hexdigest()
            for name, m in self.manifests.items()
        }
        return {
            "data": data,
            "weights": self.weights,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
        }


def data_config_problems(
    cfg: Any, model: Mapping[str, Any] | None, tokenizer_vocab: int | None = None
) -> list[str]:
    """What the app refuses before any process starts, for ``data=tokens`` runs: document
    masking where the document ids cannot reach attention (a pipeline, context parallelism),
    and a model vocabulary smaller than the ids the data holds. ``cfg`` is the app's whole
    (Hydra) config."""
    from omegaconf import OmegaConf

    from llmlab.models.registry import ARCHITECTURES

    data, strategy = (OmegaConf.to_container(cfg[k], resolve=True) for k in ("data", "strategy"))

    problems = []
    vocab = (model or {}).get("vocab_size")
    if tokenizer_vocab and isinstance(vocab, int) and vocab < tokenizer_vocab:
        problems.append(
            f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer_vocab} ids; "
            f"use model.vocab_size >= {tokenizer_vocab} (or null to take the tokenizer's)"
        )
    if not data.get("document_mask"):
        return problems
    target = str(strategy.get("_target_", ""))
    pipeline = strategy.get("pipeline", strategy.get("stages")) or 1  # both spellings
    if pipeline > 1 or target.endswith("NaiveModelParallelStrategy"):
        problems.append(
            "data.document_mask=true cannot run with pipeline parallelism "
            f"({target.rsplit('.', 1)[-1] or 'strategy'}, {pipeline} stages): stages pass one "
            "tensor between them, so the document ids would not reach the attention of later "
            "stages; use data.document_mask=false or a layout without a pipeline"
        )
    context = strategy.get("context") or 1
    if context > 1:
        problems.append(
            f"data.document_mask=true cannot run with context parallelism (strategy.context="
            f"{context}): ring attention passes key chunks between ranks without their document "
            "ids; use data.document_mask=false or strategy.context=1"
        )
    arch = (
        (model or {}).get("arch", "gpt")
        if model and ("arch" in model or "n_layer" in model)
        else None
    )
    model_cls = ARCHITECTURES[arch][0] if arch in ARCHITECTURES else None
    if model_cls is None or "document_ids" not in inspect.signature(model_cls.forward).parameters:
        problems.append(
            f"data.document_mask=true needs a model whose forward takes document_ids "
            f"(arch gpt or llama), got {arch or 'a model without arch'}"
        )
    return problems
