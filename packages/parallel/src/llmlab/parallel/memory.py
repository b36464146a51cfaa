"""Memory reuse: recompute instead of store, and a meter for what a forward keeps for backward.

Training memory is dominated by *saved activations*: every op stores the inputs its backward
needs until backward runs. Two ways to trade compute for that memory, both applied to a model
from outside (torchtitan style; this module never imports a model class):

* :func:`apply_activation_checkpointing`: a checkpointed block (one of the model's
  ``repeated_blocks()``) keeps only its input; its inside
  is recomputed during backward. Per GPT block (fp32, no dropout) the saved activations drop from
  about ``16·B·T·C`` elements (ln_1 in, qkv in, q/k/v, attention out = proj in, ln_2 in, fc
  in, 4C gelu in, 4C proj in; plus O(B·T) norm statistics) to ``B·T·C``: a factor of ~16.
* :func:`use_recompute_attention`: attention (via the model's ``swap_attention``) through
  :class:`MemoryEfficientAttention`, which
  saves q, k, v, the output and the per-row log-sum-exp ``L = m + log Σ exp(s - m)`` and
  rebuilds ``P = exp(QKᵀ/√d − L)`` block by block in backward (FlashAttention's recipe), so the
  T×T matrix is never stored: saved bytes grow like ``T`` instead of ``T²``.

:func:`saved_activation_bytes` measures the effect with ``torch.autograd.graph`` saved-tensor
hooks, attributed to the innermost module running when each tensor was saved.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from llmlab.parallel.contracts import AttentionSwappable, HasRepeatedBlocks, require

# ----------------------------------------------------------------------------- attention


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    document_ids: Tensor | None = None,
) -> Tensor:
    """``softmax(QKᵀ/√d) V`` spelled out, so autograd stores the T×T probabilities.

    The quadratic-memory baseline: PyTorch's SDPA on CPU may pick a fused kernel that does not
    store them either, which would hide the difference being measured.
    """
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], 0, q.device), -math.inf)
    if document_ids is not None:
        scores = scores.masked_fill(_other_documents(document_ids, 0, q.shape[-2]), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return probs @ v


def _causal_mask(tq: int, tk: int, offset: int, device: torch.device) -> Tensor:
    """True where query ``offset + i`` may NOT see key ``j`` (``j > i``, top-left aligned, as
    SDPA's ``is_causal``)."""
    rows = torch.arange(offset, offset + tq, device=device).unsqueeze(1)
    cols = torch.arange(tk, device=device).unsqueeze(0)
    return cols > rows


def _other_documents(document_ids: Tensor, i0: int, i1: int) -> Tensor:
    """(B, 1, i1 - i0, T) True where query ``i0 + r`` and key ``j`` are in different documents
    of a packed row (``document_ids`` (B, T)): masked, so attention is block-diagonal."""
    return (document_ids[:, i0:i1, None] != document_ids[:, None, :]).unsqueeze(1)


def _repeat_kv(t: Tensor, heads: int) -> Tensor:
    """Grouped-query attention's key/value heads repeated to ``heads``: query head ``h`` uses
    key/value head ``h // (heads / H_kv)``, as SDPA's ``enable_gqa`` (and HF's ``repeat_kv``)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_groups(t: Tensor, kv_heads: int) -> Tensor:
    """The gradient of :func:`_repeat_kv`: each key/value head gets the sum over its group."""
    B, H, T, D = t.shape
    return t if kv_heads == H else t.view(B, kv_heads, H // kv_heads, T, D).sum(dim=2)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower inputs (as FlashAttention's accumulators); fp64 stays fp64:
    where partial outputs, log-sum-exps and gradients are summed."""
    return torch.promote_types(dtype, torch.float32)


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    block_size: int = 128,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention and its per-row log-sum-exp ``L = m + log Σ exp(s - m)``, walking the
    queries in blocks of ``block_size`` rows (the transient scores are ``block_size × T``).

    Returns ``(out, lse)`` in the accumulation dtype (fp32, fp64 for fp64 inputs). ``lse`` is
    what lets partial results over different key sets be merged exactly (ring attention) and
    probabilities be rebuilt in backward (:func:`attention_backward_with_lse`).
    ``document_ids`` (B, T), for self-attention over a packed row: scores between different
    documents are masked (block-diagonal attention).
    """
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    acc = accumulation_dtype(q.dtype)
    B, H, _, D = q.shape
    # (B, T, H, D) memory seen as (B, H, T, D), like SDPA's output: the caller's
    # ``transpose(1, 2).reshape(B, T, H·D)`` is then a view, not a second copy to save.
    out = torch.empty(B, T, H, D, dtype=acc, device=q.device).transpose(1, 2)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    kf, vf = _repeat_kv(k.to(acc), H), _repeat_kv(v.to(acc), H)
    for i0 in range(0, T, block_size):
        i1 = min(i0 + block_size, T)
        s = (q[..., i0:i1, :].to(acc) @ kf.transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i1 - i0, k.shape[-2], i0, q.device), -math.inf)
        if document_ids is not None:
            s = s.masked_fill(_other_documents(document_ids, i0, i1), -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out[..., i0:i1, :] = (p @ vf) / denom
        lse[..., i0:i1] = (m + torch.log(denom)).squeeze(-1)
    return out, lse


def attention_backward_with_lse(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    block_size: int = 128,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the accumulation dtype, probabilities rebuilt from ``lse``.

    For a block of rows with ``P = exp(S − L)`` and ``Δ = rowsum(dO ∘ O)``:
    ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP − Δ)``, ``dQ = dS K / √d``,
    ``dK += dSᵀ Q / √d``. ``out`` and ``lse`` may be those of attention over a *larger* key set
    than ``k`` (ring attention passes the merged ones): the result is then exactly this key
    block's share of the gradients, and the shares over all blocks sum to the full gradients.
    """
    scale, T = 1.0 / math.sqrt(q.shape[-1]), q.shape[-2]
    acc = accumulation_dtype(q.dtype)
    H, kv_heads = q.shape[1], k.shape[1]
    qf, do = q.to(acc), grad_out.to(acc)
    kf, vf = _repeat_kv(k.to(acc), H), _repeat_kv(v.to(acc), H)
    delta = (do * out.to(acc)).sum(dim=-1)  # (B, H, T)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for i0 in range(0, T, block_size):
        i1 = min(i0 + block_size, T)
        qi, doi = qf[..., i0:i1, :], do[..., i0:i1, :]
        s = (qi @ kf.transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i1 - i0, k.shape[-2], i0, q.device), -math.inf)
        if document_ids is not None:
            s = s.masked_fill(_other_documents(document_ids, i0, i1), -math.inf)
        p = torch.exp(s - lse[..., i0:i1].unsqueeze(-1).to(acc))
        dv += p.transpose(-2, -1) @ doi
        dp = doi @ vf.transpose(-2, -1)
        ds = p * (dp - delta[..., i0:i1].unsqueeze(-1))
        dq[..., i0:i1, :] = (ds @ kf) * scale
        dk += (ds.transpose(-2, -1) @ qi) * scale
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


class MemoryEfficientAttention(torch.autograd.Function):
    """Exact attention that saves ``q, k, v, out, lse`` and recomputes probabilities in backward.

    Forward and backward both walk the queries in blocks of ``block_size`` rows
    (:func:`attention_with_lse`, :func:`attention_backward_with_lse`), so even the transient
    score matrix is ``block_size × T``. Math in fp32 (fp64 for fp64 inputs). Grouped-query
    attention (k, v with ``H_kv`` heads dividing q's ``H``): k and v are saved with their own
    heads and repeated only inside each pass; their gradients sum over groups.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        block_size: int,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        out, lse = attention_with_lse(q, k, v, causal, block_size, document_ids)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_size = causal, block_size
        ctx.document_ids = document_ids  # integer ids, no gradient: kept beside the tensors
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward_with_lse(
            grad_out, q, k, v, out, lse, ctx.causal, ctx.block_size, ctx.document_ids
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def memory_efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    block_size: int = 128,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Attention with the ``Ops.attention`` signature, through :class:`MemoryEfficientAttention`.

    Dropout on the probabilities would need the mask (or its RNG state) saved for backward; it
    is not supported, and asking for it is an error rather than a silent fallback.
    ``document_ids`` (B, T): block-diagonal attention over a packed row's documents.
    """
    if dropout_p > 0.0:
        raise ValueError(
            f"memory_efficient_attention has no attention dropout (got dropout_p={dropout_p}); "
            "train with dropout=0.0 or keep the standard attention"
        )
    if (
        q.dim() != 4
        or k.dim() != 4
        or k.shape[0] != q.shape[0]
        or q.shape[1] % k.shape[1]
        or v.shape[:-1] != k.shape[:-1]
    ):
        raise ValueError(
            "memory_efficient_attention wants q of shape (B, H, T, D) and k, v of shape "
            "(B, H_kv, T_k, D) with H_kv dividing H (grouped-query attention) and equal k/v "
            f"lengths; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if document_ids is not None and tuple(document_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"document_ids must be (B, T) = ({q.shape[0]}, {q.shape[2]}), "
            f"got {tuple(document_ids.shape)}"
        )
    return MemoryEfficientAttention.apply(q, k, v, causal, block_size, document_ids)


# ------------------------------------------------------------- applying to a model


def swap_model_attention(model: nn.Module, attention: Callable[..., Tensor], what: str) -> int:
    """Route every attention of ``model`` through ``attention`` (the ``swap_attention``
    contract); returns how many modules changed, and refuses a model where that is none."""
    swap = require(model, AttentionSwappable, what).swap_attention
    changed = swap(lambda _previous: attention)
    if changed == 0:
        raise ValueError(f"{what}: {type(model).__name__}.swap_attention changed no module")
    return changed


def use_recompute_attention(model: nn.Module, block_size: int = 128) -> int:
    """Route the model's attention through :func:`memory_efficient_attention`, in place."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = True,
        dropout_p: float = 0.0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        return memory_efficient_attention(q, k, v, causal, dropout_p, block_size, document_ids)

    return swap_model_attention(model, attention, "recompute attention")


def use_math_attention(model: nn.Module) -> int:
    """Route the model's attention through :func:`math_attention` (the quadratic baseline)."""
    return swap_model_attention(model, math_attention, "math attention")


def apply_activation_checkpointing(model: nn.Module, every: int = 1) -> list[int]:
    """Checkpoint every ``every``-th of the model's ``repeated_blocks()``, in place; returns
    their indices (blocks already wrapped are left as they are and not counted).

    Blocks are counted from 1 as torchtitan does (``every=2`` wraps blocks 1, 3, ... 0-based).
    The wrapper is PyTorch's ``checkpoint_wrapper`` (non-reentrant): its state-dict hooks drop
    the wrapper prefix, so checkpoints keep the plain ``blocks.i.*`` keys, and attribute access
    (``model.blocks[i].attn``) falls through to the block.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"activation checkpointing `every` must be a positive integer, "
                         f"got {every!r}")  # fmt: skip
    blocks = require(model, HasRepeatedBlocks, "activation checkpointing").repeated_blocks()
    if not blocks:
        raise ValueError(
            f"{type(model).__name__}.repeated_blocks() is empty: nothing to checkpoint"
        )
    parents = _parents_of(model, blocks)
    wrapped = []
    for i, block in enumerate(blocks):
        if (i + 1) % every != 0 or _is_checkpointed(block):
            continue
        parent, name = parents[id(block)]
        setattr(
            parent,
            name,
            checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True
            ),
        )
        wrapped.append(i)
    return wrapped


def _parents_of(model: nn.Module, modules: Sequence[nn.Module]) -> dict[int, tuple[nn.Module, str]]:
    """``id(module) -> (parent, attribute name)`` for each of ``modules`` inside ``model``."""
    wanted = {id(m) for m in modules}
    found: dict[int, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            if id(child) in wanted:
                found.setdefault(id(child), (parent, name))
    missing = [i for i, m in enumerate(modules) if id(m) not in found]
    if missing:
        raise ValueError(f"repeated_blocks() {missing} are not submodules of the model")
    return found


def _is_checkpointed(module: nn.Module) -> bool:
    return hasattr(module, "_checkpoint_wrapped_module")


MEMORY_OPTIONS = ("activation_checkpointing", "recompute_attention")


def apply_memory_options(model: nn.Module, **options: Any) -> dict[str, Any]:
    """The train app's hook: apply the ``model_transforms`` config to ``model``, in place.

    Keys: ``activation_checkpointing``: null, an int ``every``, or ``{every: n}``;
    ``recompute_attention``: bool, or ``{block_size: n}``. Returns what was applied (for logs).
    """
    unknown = sorted(set(options) - set(MEMORY_OPTIONS))
    if unknown:
        raise ValueError(f"unknown memory option(s) {unknown}; valid: {list(MEMORY_OPTIONS)}")
    applied: dict[str, Any] = {}
    ra = options.get("recompute_attention")
    if ra:
        kwargs = dict(ra) if isinstance(ra, dict) else {}
        if not (ra is True or isinstance(ra, dict)):
            raise ValueError(f"recompute_attention must be a bool or a dict, got {ra!r}")
        applied["recompute_attention"] = use_recompute_attention(model, **kwargs)
    ac = options.get("activation_checkpointing")
    if ac is not None and ac is not False:
        every = ac.get("every", 1) if isinstance(ac, dict) else (1 if ac is True else ac)
        applied["activation_checkpointing"] = apply_activation_checkpointing(model, every=every)
    return applied


# ----------------------------------------------------------------------- measuring


def _push(stack: list[str], name: str) -> None:
    stack.append(name)


def _pop(stack: list[str]) -> None:
    stack.pop()


@dataclass
class SavedActivations:
    """Bytes kept for backward by one forward, by the innermost module that saved them.

    Each storage is counted once (q, k and v views of one qkv output are one allocation), and
    parameters and buffers are excluded: they live anyway.
    """

    total_bytes: int
    per_module: dict[str, int] = field(default_factory=dict)  # exclusive of children

    def under(self, prefix: str) -> int:
        """Bytes saved by module ``prefix`` and everything inside it."""
        if prefix == "":
            return self.total_bytes
        return sum(
            b for n, b in self.per_module.items() if n == prefix or n.startswith(prefix + ".")
        )


def saved_activation_bytes(
    model: nn.Module,
    batch: Tensor | Sequence[Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> SavedActivations:
    """Run one forward of ``model`` on ``batch`` and report what autograd keeps for backward.

    ``batch``: the model input, or ``(inputs, targets)`` (then ``loss_fn(output, targets)`` is
    included when given). Names are those of ``model.named_modules()``, with checkpoint wrapper
    prefixes removed; bytes saved outside any submodule go to ``""``.
    """
    if isinstance(batch, Tensor):
        inputs, targets = batch, None
    elif isinstance(batch, Sequence) and len(batch) in (1, 2):
        inputs, targets = batch[0], (batch[1] if len(batch) == 2 else None)
    else:
        raise ValueError("batch must be a tensor or an (inputs, targets) pair")
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    stack = [""]
    per_module: dict[str, int] = defaultdict(int)
    seen: dict[int, Tensor] = {}  # holding the tensor keeps its address from being reused

    def pack(t: Tensor) -> Tensor:
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            ptr, nbytes = id(t), t.numel() * t.element_size()
        if nbytes and ptr not in owned and ptr not in seen:
            seen[ptr] = t
            per_module[stack[-1]] += nbytes
        return t

    handles = []
    for name, module in model.named_modules():
        clean = name.replace("._checkpoint_wrapped_module", "").replace(
            "_checkpoint_wrapped_module", ""
        )
        # (hooks must return None: a returned value would replace the module's input/output)
        handles.append(module.register_forward_pre_hook(lambda *_, n=clean: _push(stack, n)))
        handles.append(module.register_forward_hook(lambda *_: _pop(stack)))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(inputs)
            if loss_fn is not None and targets is not None:
                out = loss_fn(out, targets)
    finally:
        for h in handles:
            h.remove()
    del out
    totals = dict(per_module)
    return SavedActivations(sum(totals.values()), totals)
