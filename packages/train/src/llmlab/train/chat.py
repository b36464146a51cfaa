"""``data=chat``: supervised fine-tuning on conversations, the loss on the assistant's tokens only.

A record is one JSON line ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI's
shape, TRL's "conversational" format). Each conversation is

1. **rendered** by the tokenizer's own chat template (``chat_template`` of the HF tokenizer
   folder's ``tokenizer_config.json``, or its ``chat_template.jinja``), in the sandboxed Jinja
   environment ``transformers.apply_chat_template`` uses. The template marks what the assistant
   says with ``{% generation %}`` ... ``{% endgeneration %}`` (:data:`EXAMPLE_DIR`'s template
   does); the renderer records those character spans, as transformers' ``AssistantTracker`` does;
2. **tokenized** whole (special-token text becomes its id), and a token is the assistant's when
   its characters overlap a span -- transformers' rule for ``return_assistant_tokens_mask=True``,
   which TRL's ``assistant_only_loss`` uses, so the masks are equal (tests/train/test_chat.py);
3. turned into next-token pairs whose targets are ``IGNORE_INDEX`` (-100) wherever the target
   token is not the assistant's: the task's loss (the global mean over counted targets) is then
   the assistant tokens' mean;
4. **packed**: conversations, first-fit by decreasing length, into rows of ``block_size`` pairs,
   each row carrying ``document_ids`` (one id per conversation, padding its own), so a batch is
   ``(inputs, targets, document_ids)`` -- the batch of ``data=tokens`` with
   ``document_mask=true``: the model attends within each conversation, positions restarting at
   its first token, and every layout check of document masking applies unchanged. A
   conversation longer than ``block_size + 1`` tokens is cut there (counted in a warning).

The records are read through HF ``datasets`` (an Arrow table, cached), line by line as
``make data`` reads JSON lines (:mod:`llmlab.train.documents`): a bad record (not JSON, no
``messages`` list, a message without a string ``role``/``content``, no assistant turn, a template
that refuses it) is skipped with its file and line in a warning and counted in the summary, or
refused with them under ``strict``. The validation split is the records whose text hashes below
``val_fraction`` (the rule ``make data`` splits documents by), or ``val_files``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from llmlab.parallel.loss_mean import IGNORE_INDEX
from llmlab.train.chat_records import Record as Record
from llmlab.train.chat_records import files_list, read_split_records
from llmlab.train.chat_records import read_records as read_records
from llmlab.train.documents import BadRecords
from llmlab.train.global_batch import GlobalBatchDataModule

log = logging.getLogger(__name__)

# The example that ships with llmlab.train: a made-up tokenizer folder (byte-level BPE, 384 ids,
# a ChatML-style template with {% generation %} marks), 48 conversations and 32 preference pairs.
EXAMPLE_DIR = Path(__file__).resolve().parent / "examples" / "chat"
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")


# --------------------------------------------------------------------------- the template
def _compile(source: str) -> Any:
    """``source`` in transformers' chat-template environment, plus the ``generation`` tag."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while a render
        tracks, records the body's character span in the output so far."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.tracking: tuple[list[str], list[tuple[int, int]]] | None = None
            environment.extend(track_generation=self.track)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_span", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            if self.tracking is not None:
                blocks, spans = self.tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            self.tracking = (blocks, spans)
            try:
                yield
            finally:
                self.tracking = None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """A tokenizer folder's chat template, rendering with the assistant's character spans."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        import jinja2

        try:
            self.template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not parse: {err}") from err
        self.source = source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... by role
        if "generation" not in source:
            raise ValueError(
                "the chat template has no {% generation %} ... {% endgeneration %} block, so it "
                "does not say which tokens are the assistant's (the loss is on those only); "
                f"add the marks around what the assistant says (see {EXAMPLE_DIR}/"
                "tokenizer_config.json)"
            )

    @classmethod
    def from_path(cls, path: str | Path) -> ChatTemplate:
        """The template of a tokenizer folder (``chat_template.jinja``, else
        ``tokenizer_config.json``'s ``chat_template``), of the folder of a ``tokenizer.json``
        given instead, or of a ``.jinja`` file."""
        path = Path(path)
        if path.is_file() and path.suffix == ".jinja":
            return cls(path.read_text(encoding="utf-8"))
        folder = path if path.is_dir() else path.parent
        config_file = folder / "tokenizer_config.json"
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
        specials = {
            k: _token_text(v) for k, v in config.items() if k.endswith("_token") and v is not None
        }
        if (folder / "chat_template.jinja").is_file():
            return cls((folder / "chat_template.jinja").read_text(encoding="utf-8"), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the "default" one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ValueError(
                f"{folder} has no chat template (neither chat_template.jinja nor a chat_template "
                "in tokenizer_config.json); set data.template to a folder or .jinja file that has"
            )
        return cls(source, specials)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, the assistant's character spans ``[start, end)`` in it); a template's own
        ``raise_exception`` becomes a ``ValueError`` with its message."""
        import jinja2

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        kwargs = {
            **self.special_tokens,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            with self.template.environment.track_generation(blocks, spans):
                for block in self.template.generate(**kwargs):
                    blocks.append(block)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from err
        return "".join(blocks), spans


# --------------------------------------------------------------------------- tokens
def tokenize_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> tuple:
    """(ids, mask): ``text`` encoded whole (special-token text as its id) and, per token,
    whether its characters ``[start, end)`` overlap one of ``spans`` (transformers' rule)."""
    ids = tokenizer.encode(text, allowed_special="all")
    decoded, starts = tokenizer.decode_with_offsets(ids)
    if decoded != text:
        raise ValueError(
            f"{type(tokenizer).__name__} does not decode to the text it encoded, so its tokens "
            "cannot be matched to the template's assistant spans; use a byte-level tokenizer"
        )
    ends = [*starts[1:], len(text)]
    mask = np.zeros(len(ids), dtype=bool)
    for i, (start, end) in enumerate(zip(starts, ends)):
        mask[i] = any(end > s and start < e for s, e in spans)
    return np.asarray(ids, dtype=np.int64), mask


def messages_problem(messages: Any, need_assistant: bool = True) -> str | None:
    """Why ``messages`` is not a conversation (``None`` when it is)."""
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not an object"
        if not isinstance(m.get("role"), str):
            return f"message {i} has no string 'role'"
        if not isinstance(m.get("content"), str):
            return f"message {i} ({m['role']}) has no string 'content'"
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        return "no assistant message (nothing to learn from)"
    return None


# --------------------------------------------------------------------------- packing
@dataclass
class Example:
    """One conversation as next-token pairs: ``inputs`` and ``targets`` (``IGNORE_INDEX`` where
    the target is not the assistant's)."""

    inputs: np.ndarray
    targets: np.ndarray


def example_of(ids: np.ndarray, mask: np.ndarray, block_size: int) -> tuple[Example, bool]:
    """(pairs of ``ids``, whether they were cut to ``block_size``)."""
    cut = len(ids) > block_size + 1
    ids, mask = ids[: block_size + 1], mask[: block_size + 1]
    targets = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    return Example(ids[:-1].copy(), targets.astype(np.int64)), cut


def pack(examples: Sequence[Example], block_size: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets, document_ids), each (rows, ``block_size``): the examples first-fit by
    decreasing length into rows (the order is deterministic: ties keep the input order); a
    row's documents are numbered from 0 and its padding (input ``pad_id``, target
    ``IGNORE_INDEX``) is a document of its own."""
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].inputs))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(examples[i].inputs)
        slot = next((r for r, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([])
            free.append(block_size)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n
    inputs = np.full((len(rows), block_size), pad_id, dtype=np.int64)
    targets = np.full((len(rows), block_size), IGNORE_INDEX, dtype=np.int64)
    docs = np.zeros((len(rows), block_size), dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = len(examples[i].inputs)
            inputs[r, at : at + n] = examples[i].inputs
            targets[r, at : at + n] = examples[i].targets
            docs[r, at : at + n] = d
            at += n
        docs[r, at:] = len(members)
    return inputs, targets, docs


class PackedRows(Dataset):
    """Row ``i`` of packed arrays: (inputs, targets, document ids or None)."""

    def __init__(self, arrays: tuple[np.ndarray, ...], docs: bool) -> None:
        self.arrays, self.docs = arrays, docs

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        inputs, targets, docs = (a[i] for a in self.arrays)
        return inputs, targets, (docs if self.docs else None)


def collate_rows(rows: list[tuple[np.ndarray, ...]]) -> tuple[torch.Tensor, ...]:
    """(inputs, targets) or (inputs, targets, document_ids), each (B, T) int64: the batch of
    ``data=tokens`` (:func:`llmlab.train.tokens.collate_windows`)."""
    columns = [r for r in zip(*rows) if r[0] is not None]
    return tuple(torch.from_numpy(np.stack(c)) for c in columns)


def pad_id_of(tokenizer: Any) -> int:
    """The id padding inputs carry (never a target): the tokenizer's pad or end-of-text token,
    else 0."""
    specials = dict(getattr(tokenizer, "special_tokens", {}) or {})
    for name in ("<|endoftext|>", "<pad>", "<|pad|>", "</s>", "<|end_of_text|>"):
        if name in specials:
            return int(specials[name])
    return 0


class ChatDataModule(GlobalBatchDataModule):
    """Conversations of ``files`` (JSON lines of ``messages``), rendered by the chat template,
    masked to the assistant's tokens and packed with document ids (module docstring); global
    batches split by data-parallel rank (:mod:`llmlab.train.global_batch`)."""

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
        document_mask: bool = True,
        strict: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        """``template``: the chat template's tokenizer folder, ``tokenizer.json`` or ``.jinja``
        file (the config passes ``tokenizer.path``). ``val_files``: held-out conversations;
        without them a ``val_fraction`` of ``files`` by hash. ``document_mask=false`` packs
        without document ids (attention then crosses conversations in a row)."""
        super().__init__(batch_size, seed)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"data.block_size must be a positive integer, got {block_size!r}")
        if template is None:
            raise ValueError(
                "data=chat needs a chat template: data.template (a tokenizer folder, its "
                "tokenizer.json or a .jinja file) defaults to the folder of tokenizer.path, and "
                "this tokenizer has none; use tokenizer=pretrained (a model folder's) or "
                "tokenizer=chat_example"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction!r}")
        self.block_size, self.document_mask = block_size, bool(document_mask)
        self.template = ChatTemplate.from_path(template)
        self.report = BadRecords(strict=strict)
        records = read_split_records(files, val_files, val_fraction, self.report, cache_dir)
        self.splits: dict[str, tuple[np.ndarray, ...]] = {}
        examples: dict[str, list[Example]] = {"train": [], "validation": []}
        cut = 0
        for record in records:
            result = self.encode(record, tokenizer)
            if result is None:
                continue
            example, was_cut = example_of(*result, block_size)
            if not (example.targets != IGNORE_INDEX).any():
                detail = f"no assistant token within the first {block_size + 1} tokens"
                self.report.bad(record.source, record.where, "no assistant tokens", detail)
                continue
            cut += was_cut
            examples["validation" if record.validation else "train"].append(example)
        if summary := self.report.summary():
            log.warning("warning: chat data: %s", summary.replace("--strict", "data.strict=true"))
        if cut:
            log.warning(
                "warning: chat data: %d conversation(s) longer than block_size + 1 = %d "
                "tokens were cut there",
                cut,
                block_size + 1,
            )
        pad = pad_id_of(tokenizer)
        for split, items in examples.items():
            if not items:
                raise ValueError(
                    f"data=chat: no usable {split} conversation in {files_list(files)}"
                    + (f" + {files_list(val_files)}" if val_files else "")
                    + ("" if split == "train" else "; raise data.val_fraction or give val_files")
                )
            self.splits[split] = pack(items, block_size, pad)
            rows = len(self.splits[split][0])
            if rows < batch_size:
                raise ValueError(
                    f"data=chat: the {split} split packs into {rows} rows of {block_size} "
                    f"tokens, fewer than one global batch of {batch_size}; lower "
                    "data.batch_size or model.block_size, or add conversations"
                )
        counted = {s: int((a[1] != IGNORE_INDEX).sum()) for s, a in self.splits.items()}
        log.info(
            "chat: %d train / %d validation conversations in %d / %d rows of %d tokens; "
            "%d / %d assistant targets",
            len(examples["train"]),
            len(examples["validation"]),
            len(self.splits["train"][0]),
            len(self.splits["validation"][0]),
            block_size,
            counted["train"],
            counted["validation"],
        )

    def encode(self, record: Record, tokenizer: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, assistant mask) of a record, or ``None`` (reported) when it is bad."""
        messages = record.value.get("messages")
        problem = messages_problem(messages) if "messages" in record.value else "no 'messages'"
        if problem is None:
            try:
                return tokenize_spans(tokenizer, *self.template.render(messages))
            except ValueError as err:
                problem = str(err)
        kind = re.sub(r"\d+", "N", problem.split(" (")[0].split(":")[0])  # "message N has ..."
        self.report.bad(record.source, record.where, kind, problem)
        return None

    def split_dataset(self, split: str) -> Dataset:
        return PackedRows(self.splits[split], self.document_mask)

    def collate(self, rows: list[tuple[np.ndarray, ...]]) -> tuple[torch.Tensor, ...]:
        return collate_rows(rows)

    def identity(self) -> dict[str, Any]:
        rows = hashlib.sha1(b"".join(a.tobytes() for a in self.splits["train"])).hexdigest()
        return {
            "data": rows,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
        }
