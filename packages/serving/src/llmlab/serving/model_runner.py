"""The model runner: the KV pool's tensors, and one forward of the model over a packed batch.

A step's chunks (sequence, first new position, token count) become one row of ``N`` tokens:
``input_ids`` and ``positions`` (1, N), each token's *slot* in the pool (``slot_mapping``),
each sequence's block table and context length, and the offsets of its queries
(``query_start``). The runner hands that metadata to the model's own forward as its attention
context (:class:`PagedAttention`, see ``llmlab.models.attention``): every attention layer
calls ``attend(layer, q, k, v)``, which writes the new keys and values into their slots and
attends through the block tables with ``llmlab.kernels.paged_attention``. Only the rows whose
chunk reaches its sequence's end go through the LM head (``logits_to_keep``), and every row of
a prompt chunk whose request asked for its prompt's log-probabilities (no second forward).
With LoRA adapters served (``llmlab.serving.adapters``) the runner also sets each token's
adapter slot around that forward, a step-scoped context the adapter layers read. With
``EngineConfig.compile`` steps of decodes only go through the compiled forward instead
(``llmlab.serving.compiled_decode``), over the same pool plus one spare block for its padding.

The model is never changed: no attention swapped in, no weights re-laid or copied; the same
forward trains, decodes and serves (nano-vllm's ``model_runner.py`` and ``utils/context.py``,
vLLM's forward context, are the pattern). Speed comes from what every model gets: fewer bytes
per weight (``EngineConfig.quantize``, ``llmlab.models.quantize``) and the kernels.

The pool is one pair of tensors per layer, ``(num_blocks, block_size, H_kv, D)``, zeroed at
start so a masked slot never holds NaN; one tensor where the layer hands the same tensor as its
keys and values (latent attention's compressed latent, DeepSeek-V3: the pool keeps it once).
Its shapes come from a probe: one single-token forward whose attention context records each
layer's ``k`` heads, head dim, dtype, sliding window and whether ``v is k`` (the device is the
model's).
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llmlab.kernels.paged_attention import PagedLayout, Scratch, paged_attention
from llmlab.serving.adapters import ServedAdapters
from llmlab.serving.compiled_decode import CompiledDecode
from llmlab.serving.config import EngineConfig
from llmlab.serving.contracts import check_paged_model
from llmlab.serving.scheduler import Chunk


class KVPool:
    """Per-layer key and value blocks, shared by every sequence through block tables.

    ``shapes``: ``(KV heads, head dim, values are keys)`` per layer; where the values are the
    keys (a compressed latent attended as both), ``values[i] is keys[i]``: one tensor."""

    def __init__(
        self,
        shapes: list[tuple[int, int, bool]],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.keys = [
            torch.zeros(num_blocks, block_size, h, d, dtype=dtype, device=device)
            for h, d, _ in shapes
        ]
        self.values = [
            k if shared else torch.zeros_like(k)
            for k, (*_, shared) in zip(self.keys, shapes, strict=True)
        ]

    def tensors(self) -> list[Tensor]:
        """Every distinct pool tensor (a layer whose values are its keys counts once)."""
        return [*self.keys, *(v for k, v in zip(self.keys, self.values, strict=True) if v is not k)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` receives block ``src``'s keys and values, every layer."""
        src = torch.tensor([s for s, _ in copies], device=self.keys[0].device)
        dst = torch.tensor([d for _, d in copies], device=self.keys[0].device)
        for t in self.tensors():
            t.index_copy_(0, dst, t.index_select(0, src))


@dataclass(eq=False)
class PagedAttention:
    """The attention context of one engine step (``llmlab.models.attention``): the new tokens'
    pool slots and the block-table layout every layer reads."""

    pool: KVPool
    slot_mapping: Tensor  # (N,) pool slot of each new token
    layout: PagedLayout  # block tables (padded with block 0), query offsets, context lengths
    backend: str

    def begin(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Any) -> Tensor:
        if positions is None or attention_mask is not None:
            raise ValueError("a paged step takes the runner's positions and no attention_mask")
        return positions

    def attend(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None
    ) -> Tensor:
        """``q`` (1, H, N, D), ``k``/``v`` (1, H_kv, N, D) -> (1, H, N, D), in ``q``'s dtype
        (computed in the pool's: a bf16 pool attends in bf16)."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        heads, dim, dtype = keys.shape[2], keys.shape[3], keys.dtype
        keys.view(-1, heads, dim).index_copy_(0, self.slot_mapping, k[0].transpose(0, 1).to(dtype))
        if values is keys and v is not k:
            raise ValueError(
                f"layer {layer_idx} handed the same tensor as keys and values when the pool was "
                "probed (one buffer kept) but different ones now"
            )
        if values is not keys:
            values.view(-1, heads, dim).index_copy_(
                0, self.slot_mapping, v[0].transpose(0, 1).to(dtype)
            )
        out = paged_attention(
            q[0].transpose(0, 1).to(dtype), keys, values, self.layout, backend=self.backend
        )
        return out.transpose(0, 1)[None].to(q.dtype)

    def end(self, num_tokens: int) -> None:
        pass


class _Probe:
    """The context of the probing forward: records what each layer hands over (KV heads, head
    dim, dtype, window) and attends plainly (one token sees itself)."""

    def __init__(self) -> None:
        self.layers: list[tuple[int, int, bool, torch.dtype, int | None]] = []

    def begin(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Any) -> Tensor:
        return positions

    def attend(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None
    ) -> Tensor:
        if layer_idx != len(self.layers):
            raise TypeError(
                f"attention layers must attend in order; layer {layer_idx} came "
                f"after {len(self.layers)} layers"
            )
        self.layers.append((k.shape[1], k.shape[3], v is k, k.dtype, window))
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # softmax over one key

    def end(self, num_tokens: int) -> None:
        pass


def _check_triton_runs(device: torch.device) -> None:
    """Refuse ``attention_backend="triton"`` where the kernel cannot run (found at startup, not
    by the first request)."""
    from llmlab.kernels._runtime import interpreter_requested, triton_available

    if not triton_available():
        raise ValueError(
            "attention_backend='triton': triton is not installed; use 'auto' or 'torch'"
        )
    if device.type != "cuda" and not (device.type == "cpu" and interpreter_requested()):
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device (the model is on {device}) or "
            f"TRITON_INTERPRET=1 for CPU tensors; use 'auto' or 'torch' here"
        )


class ModelRunner:
    def __init__(
        self, model: Any, config: EngineConfig, adapters: ServedAdapters | None = None
    ) -> None:
        check_paged_model(model)
        self.model = model
        self.config = config
        self.adapters = adapters  # LoRA adapters: each token's is set around the forward
        self.device = next(iter(model.parameters())).device
        self.backend = config.attention_backend
        if self.backend == "auto":
            self.backend = "triton" if self.device.type == "cuda" else "torch"
        elif self.backend == "triton":
            _check_triton_runs(self.device)
        self.scratch = Scratch()  # gather buffers reused by every forward
        shapes, dtype = self._probe_shapes()
        if config.kv_cache_dtype != "auto":
            dtype = getattr(torch, config.kv_cache_dtype)
        self.num_layers = len(shapes)
        blocks = config.num_blocks + (1 if config.compile else 0)  # + the padding rows' block
        self.pool = KVPool(shapes, blocks, config.block_size, dtype, self.device)
        self.compiled = None
        if config.compile:  # (refused for LoRA adapters and MoE models, by LLMEngine)
            self.compiled = CompiledDecode(model, self.pool.keys, self.pool.values,
                                           config.block_size, config.num_blocks,
                                           config.max_num_seqs)  # fmt: skip

    @torch.inference_mode()
    def _probe_shapes(self) -> tuple[list[tuple[int, int, bool]], torch.dtype]:
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        probe = _Probe()
        self.model(one, positions=one, attention=probe, logits_to_keep=one[0])
        name = type(self.model).__name__
        if not probe.layers:
            raise TypeError(f"{name}'s forward called no attention layer through its context")
        dtypes = {layer[3] for layer in probe.layers}
        if len(dtypes) != 1:
            raise TypeError(
                f"{name}'s attention layers disagree on the KV dtype: {sorted(map(str, dtypes))}"
            )
        longest = self.config.max_model_len or self.model.config.block_size
        short = {i: w for i, (*_, w) in enumerate(probe.layers) if w is not None and w < longest}
        if short:
            raise ValueError(
                f"{name}: layers {sorted(short)} attend through a sliding window of "
                f"{min(short.values())} tokens, which paged attention does not apply; serve with "
                f"max_model_len <= {min(short.values())}"
            )
        return [(h, d, shared) for h, d, shared, *_ in probe.layers], dtypes.pop()

    # --------------------------------------------------------------------------- a step
    def prepare(
        self, chunks: list[Chunk], every_row: Collection[int] = ()
    ) -> tuple[Tensor, Tensor, PagedAttention, Tensor | int]:
        """``input_ids`` and ``positions`` (1, N), the step's attention context and the rows
        whose logits are wanted (0: every row, as in a step of decodes): the last row of each
        chunk that completes its sequence, and every row of the chunks numbered in
        ``every_row`` (a prompt whose log-probabilities are asked for)."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        keep: list[int] = []
        for i, chunk in enumerate(chunks):
            seq, s = chunk.seq, chunk.start
            e = s + chunk.num_tokens
            table = seq.block_table
            ids += seq.token_ids[s:e]
            positions += range(s, e)
            slots += [table[p // bs] * bs + p % bs for p in range(s, e)]
            starts.append(starts[-1] + chunk.num_tokens)
            lens.append(e)
            if i in every_row:
                keep += range(starts[-2], starts[-1])
            elif chunk.completes:
                keep.append(starts[-1] - 1)
        width = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in chunks]

        def tensor(values: Any, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        layout = PagedLayout(
            tensor(tables, torch.int32),
            tensor(starts, torch.int32),
            tensor(lens, torch.int32),
            bs,
            self.scratch,
        )
        context = PagedAttention(self.pool, tensor(slots), layout, self.backend)
        # decode-only steps want every row: 0 (HF's "all") skips a gather before the head
        logits_indices = 0 if len(keep) == starts[-1] else tensor(keep)
        return tensor([ids]), tensor([positions]), context, logits_indices

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[Chunk],
        copies: list[tuple[int, int]] = (),
        every_row: Collection[int] = (),
    ) -> Tensor:
        """Run one forward; float32 logits (K, V) of the rows :meth:`prepare` keeps, in order:
        one per chunk that completes its sequence, every row of the chunks in ``every_row``."""
        if copies:
            self.pool.copy_blocks(copies)
        if self.compiled is not None and self.compiled.applies(chunks, every_row):
            return self.compiled(chunks)
        input_ids, positions, context, keep = self.prepare(chunks, every_row)
        adapters = self.adapters.step(chunks, self.device) if self.adapters else nullcontext()
        with adapters:
            logits = self.model(
                input_ids, positions=positions, attention=context, logits_to_keep=keep
            )
        return logits[0].float()
