"""``data=preference``: preference pairs for ``task=dpo`` (:mod:`llmlab.train.dpo`).

A record is one JSON line with ``prompt``, ``chosen`` and ``rejected``, either strings (TRL's
"standard" format: the completions end with the tokenizer's end-of-sequence token, appended
when missing) or chat messages (TRL's "conversational" format: ``prompt`` a list of messages,
``chosen`` / ``rejected`` the assistant's messages, or a string as one assistant message),
rendered by the tokenizer folder's chat template (:class:`llmlab.train.chat.ChatTemplate`).

Tokenized as TRL's ``DPOTrainer`` does: the prompt alone (chat: with the generation prompt) and
prompt + completion, each whole; the completion is what follows their common prefix (shortest of
the two pairs), and only its tokens are targets (the rest ``IGNORE_INDEX``). Each sequence is
cut to ``block_size + 1`` tokens from its start (counted in a warning); a pair whose prompt
leaves no completion token is skipped as bad (file and line), like every record that is not a
pair. Rows are padded to ``block_size``; a batch is ``(inputs, targets, pair index)`` with the
chosen rows first and the rejected rows after them (TRL's order): ``(2b, T)``, ``(2b, T)``,
``(b,)``. The pair index is the pair's place in its split, for precomputed reference
log-probabilities.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from llmlab.parallel.loss_mean import IGNORE_INDEX
from llmlab.train.chat import ChatTemplate, messages_problem, pad_id_of
from llmlab.train.chat_records import read_split_records
from llmlab.train.documents import BadRecords
from llmlab.train.global_batch import GlobalBatchDataModule

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def completion_messages(value: Any) -> list[dict[str, Any]] | None:
    """A conversational completion as messages: a list as it is, a string as one assistant
    message."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return value if isinstance(value, list) else None


class PreferencePairs(Dataset):
    """Pair ``i``: (chosen inputs, chosen targets, rejected inputs, rejected targets, i)."""

    def __init__(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return (*(a[i] for a in self.arrays), i)


def collate_pairs(rows: list[tuple[Any, ...]]) -> tuple[torch.Tensor, ...]:
    """(inputs (2b, T), targets (2b, T), pair index (b,)): chosen rows, then rejected rows."""
    ci, ct, ri, rt, index = zip(*rows)
    inputs = torch.from_numpy(np.stack([*ci, *ri]))
    targets = torch.from_numpy(np.stack([*ct, *rt]))
    return inputs, targets, torch.tensor(index, dtype=torch.int64)


class PreferenceDataModule(GlobalBatchDataModule):
    """Preference pairs of ``files`` (module docstring), global batches of ``batch_size`` pairs
    split by data-parallel rank (:mod:`llmlab.train.global_batch`)."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        template: str | None = None,
        val_files: str | Sequence[str] | None = None,
        val_fraction: float = 0.1,
        block_size: int = 128,
        batch_size: int = 8,
        seed: int = 1337,
        strict: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        """``template``: the tokenizer folder (or ``tokenizer.json``, or ``.jinja``) whose chat
        template renders chat pairs and whose ``eos_token`` ends string completions."""
        super().__init__(batch_size, seed)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"data.block_size must be a positive integer, got {block_size!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}")
        self.block_size, self.tokenizer = block_size, tokenizer
        self.template = None if template is None else ChatTemplate.from_path(template)
        self.report = BadRecords(strict=strict)
        records = read_split_records(files, val_files, val_fraction, self.report, cache_dir)
        pairs: dict[str, list[tuple[np.ndarray, ...]]] = {"train": [], "validation": []}
        self.cut = 0
        for record in records:
            try:
                pair = self.encode(record.value)
            except ValueError as err:
                self.report.bad(record.source, record.where, str(err).split(" (")[0], str(err))
                continue
            pairs["validation" if record.validation else "train"].append(pair)
        if summary := self.report.summary():
            log.warning(
                "warning: preference data: %s", summary.replace("--strict", "data.strict=true")
            )
        if self.cut:
            log.warning(
                "warning: preference data: %d sequence(s) longer than block_size + 1 = "
                "%d tokens were cut there",
                self.cut,
                block_size + 1,
            )
        self.splits: dict[str, tuple[np.ndarray, ...]] = {}
        for split, items in pairs.items():
            if len(items) < batch_size:
                raise ValueError(
                    f"data=preference: the {split} split holds {len(items)} usable pairs, fewer "
                    f"than one global batch of {batch_size}; lower data.batch_size or add pairs"
                    + ("" if split == "train" else " (raise data.val_fraction or give val_files)")
                )
            self.splits[split] = tuple(np.stack(column) for column in zip(*items))
        log.info(
            "preference: %d train / %d validation pairs, rows of %d tokens",
            len(pairs["train"]),
            len(pairs["validation"]),
            block_size,
        )

    # ----------------------------------------------------------------- tokenizing
    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, allowed_special="all"))

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        assert self.template is not None
        return self.template.render(messages, add_generation_prompt=generation_prompt)[0]

    def encode(self, record: dict[str, Any]) -> tuple[np.ndarray, ...]:
        """(chosen inputs, targets, rejected inputs, targets) of a record; ``ValueError`` says
        why a record is not a usable pair."""
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise ValueError(f"no {missing[0]!r} field (a pair has prompt, chosen, rejected)")
        prompt = record["prompt"]
        if isinstance(prompt, list):  # conversational
            if self.template is None:
                raise ValueError("chat messages need a chat template (data.template)")
            if problem := messages_problem(prompt, need_assistant=False):
                raise ValueError(f"prompt: {problem}")
            prompt_ids = self._ids(self._render(prompt, True))
            full = []
            for key in ("chosen", "rejected"):
                messages = completion_messages(record[key])
                if messages is None or (problem := messages_problem(messages)):
                    raise ValueError(f"{key}: {problem or 'not messages or a string'}")
                full.append(self._ids(self._render(prompt + messages, False)))
        elif isinstance(prompt, str):
            eos = (self.template.special_tokens.get("eos_token") if self.template else None) or ""
            full = []
            for key in ("chosen", "rejected"):
                value = record[key]
                if not isinstance(value, str):
                    raise ValueError(f"{key} is {type(value).__name__}, not a string as the prompt")
                full.append(self._ids(prompt + (value if value.endswith(eos) else value + eos)))
            prompt_ids = self._ids(prompt)
        else:
            raise ValueError(f"prompt is {type(prompt).__name__}, not a string or messages")
        start = min(common_prefix(prompt_ids, ids) for ids in full)
        rows = []
        for ids in full:
            ids = np.asarray(ids, dtype=np.int64)
            self.cut += len(ids) > self.block_size + 1
            ids = ids[: self.block_size + 1]
            if len(ids) <= start:
                raise ValueError(
                    f"no completion token within the first {self.block_size + 1} tokens (the "
                    f"prompt has {start}); raise model.block_size"
                )
            inputs = np.full(self.block_size, pad_id_of(self.tokenizer), dtype=np.int64)
            targets = np.full(self.block_size, IGNORE_INDEX, dtype=np.int64)
            inputs[: len(ids) - 1] = ids[:-1]
            first = max(start, 1)  # the first token of a row is never a target
            targets[first - 1 : len(ids) - 1] = ids[first:]  # the completion's tokens
            rows += [inputs, targets]
        return tuple(rows)

    # ----------------------------------------------------------------- Lightning
    def split_dataset(self, split: str) -> Dataset:
        return PreferencePairs(self.splits[split])

    def collate(self, rows: list[tuple[Any, ...]]) -> tuple[torch.Tensor, ...]:
        return collate_pairs(rows)

    def identity(self) -> dict[str, Any]:
        rows = hashlib.sha1(b"".join(a.tobytes() for a in self.splits["train"])).hexdigest()
        return {
            "data": rows,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
        }
