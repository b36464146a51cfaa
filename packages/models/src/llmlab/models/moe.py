"""A mixture-of-experts layer: a router, routed experts, optional shared experts, and the losses
and statistics that go with routing. It takes the place of a block's MLP (``Llama`` builds it
where ``LlamaConfig.moe_layers`` says), maps ``(B, T, C) -> (B, T, C)`` like the MLP, and keeps
what it measured in :attr:`MoE.stats` for the training side to read after the forward.

**Routing** (:class:`Router`). Router logits ``s = x W_r^T`` (E experts), then either

* ``scoring="softmax"`` (Mixtral, Qwen2/3-MoE): ``p = softmax(s)``, the top-k experts by ``p``,
  their weights ``p_topk`` renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always,
  Qwen by its config flag; Qwen2-MoE checkpoints mostly not);
* ``scoring="sigmoid"`` (DeepSeek-V3): ``σ = sigmoid(s)``; the *choice* uses ``σ + b`` with a
  per-expert bias ``b`` that no gradient reaches, limited to the ``topk_group`` best of
  ``n_group`` expert groups (a group's score: the sum of its two best ``σ + b``); the weights are
  the chosen experts' unbiased ``σ``, renormalised when ``norm_topk_prob``.

Both multiply the weights by ``routed_scaling_factor``. Token ``t``'s output is
``Σ_{e ∈ topk(t)} w_{t,e} · FFN_e(x_t)`` plus the shared experts' ``FFN_s(x_t)`` (Qwen2-MoE
gates it: ``sigmoid(x_t · g) · FFN_s(x_t)``). Each ``FFN`` is the gated SwiGLU MLP
``down(silu(gate(x)) * up(x))``; the routed experts' weights are stacked ``(E, out, in)``
parameters.

**Expert computation**: two implementations of the same function. ``"loop"`` is the reference
(per expert: find its tokens, run its MLP, add the weighted result back, as HF's eager
experts do). ``"grouped"`` sorts the ``N·k`` (token, expert) assignments by expert (a stable
sort, so each expert's tokens stay in token order), gathers the tokens once, and runs the three
projections over all experts at once with ``torch.nn.functional.grouped_mm``: expert ``e``
reads rows ``[offs[e-1], offs[e])``, one contiguous slice. Where ``grouped_mm`` cannot run (a
torch without it; rows not 16-byte aligned; CUDA in a dtype other than bf16) the same sorted
slices go through one matmul per expert (``moe_dispatch.segment_matmul``): the same layout, a
loop over slices instead of one kernel (the dispatch's pieces live in
:mod:`llmlab.models.moe_dispatch`). Results go back by putting each assignment's row in its
``(token, slot)`` place and weighing and summing the ``k`` slots in one ``(1, k) @ (k, C)``
product per token: deterministic, no atomics. The gather and that combine are autograd
functions (:func:`dispatch_rows`, :func:`combine_rows`) whose backward is the same permutation
the other way plus the sum over slots, not autograd's accumulating scatter for ``x[idx]``
(on CPU the slowest step of dispatch; ``benchmarks/moe.py`` measures the whole block).

**Capacity** (optional ``capacity_factor`` ``c``): each expert takes at most
``C = ceil(c · N · k / E)`` assignments, the first ``C`` in token order; the rest are dropped
(their weight contributes nothing: the token keeps its residual and shared-expert paths) and
counted in ``stats.dropped``, never silently.

**Losses and statistics** (:class:`MoEStats`, per layer, after each forward):

* the load-balancing loss of Switch / HF (``load_balancing_loss_func``):
  ``E · Σ_e f_e · P_e`` with ``f_e`` the assignments to ``e`` per token (summed over the k
  slots) and ``P_e`` the mean router probability of ``e``; across layers
  :func:`load_balancing_loss` pools the counts and probabilities of all layers first, exactly
  as HF does (its aux loss is not the mean of per-layer losses). For the sigmoid router the
  probabilities are ``σ`` normalised over the experts (DeepSeek's affinities);
* the router z-loss of ST-MoE: ``mean_t (logsumexp_e s_{t,e})²``;
* tokens per expert (assignments routed, before any drop), dropped assignments per expert,
  their max / mean load.

**Expert parallelism** reaches the layer through two methods and nothing else (the contract
``ExpertParallelizable`` that ``llmlab.parallel.contracts`` declares; this module imports none of
it): :meth:`MoE.expert_parameters` names the stacked ``(E, ...)`` weights, and
:meth:`MoE.swap_experts` replaces the expert computation ``fn(rows sorted by expert, counts per
expert) -> rows`` by ``wrap(fn)``. Expert parallelism keeps a slice of the experts on each rank
and wraps ``fn`` in an all-to-all that sends each row to its expert's rank and back; the router,
the sort, the capacity drop, the weighting and the combine stay here, unchanged. A swapped layer
always runs the sorted (grouped) dispatch: ``"loop"`` is the same function, computed in place.

**Auxiliary-loss-free balancing** (DeepSeek-V3): :meth:`MoE.update_bias` moves each expert's
selection bias by ``±γ`` toward balance (``b_e += γ · sign(mean load - load_e)``), without a
gradient; the training side calls it after each step (with counts summed over its data ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.models.linear import Linear
from llmlab.models.moe_dispatch import combine_rows, dispatch_rows, grouped_matmul

SCORINGS = ("softmax", "sigmoid")
IMPLEMENTATIONS = ("grouped", "loop")


@dataclass(frozen=True)
class MoEConfig:
    """The hyper-parameters of one MoE layer (module docstring)."""

    dim: int  # the residual width
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's MLP width
    scoring: str = "softmax"  # "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    n_group: int = 1  # sigmoid routing: expert groups, of which the best topk_group are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # the shared experts' (summed) width; 0: none
    shared_gate: bool = False  # Qwen2-MoE: the shared expert scaled by sigmoid(x · g)
    capacity_factor: float | None = None  # None: no capacity, nothing dropped
    implementation: str = "grouped"  # "grouped" or "loop" (the reference)

    def validate(self, where: str = "MoEConfig") -> None:
        for name in ("dim", "num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{where}: top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"{where}: scoring={self.scoring!r}; valid: {list(SCORINGS)}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"{where}: implementation={self.implementation!r}; valid: {list(IMPLEMENTATIONS)}"
            )
        if self.n_group > 1 or self.topk_group > 1:
            if self.scoring != "sigmoid":
                raise ValueError(
                    f"{where}: group-limited routing (n_group={self.n_group}, topk_group="
                    f"{self.topk_group}) is implemented for scoring='sigmoid' (DeepSeek-V3) only"
                )
            per_group = self.num_experts // self.n_group
            if self.num_experts % self.n_group or per_group < 2:
                raise ValueError(
                    f"{where}: num_experts={self.num_experts} must split into n_group="
                    f"{self.n_group} equal groups of at least 2 experts"
                )
            if not self.topk_group <= self.n_group or self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"{where}: topk_group={self.topk_group} of n_group={self.n_group} groups of "
                    f"{per_group} experts cannot hold top_k={self.top_k} experts"
                )
        if not self.routed_scaling_factor > 0:
            raise ValueError(
                f"{where}: routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}"
            )
        if not isinstance(self.shared_intermediate_size, int) or self.shared_intermediate_size < 0:
            raise ValueError(
                f"{where}: shared_intermediate_size must be an integer >= 0, got "
                f"{self.shared_intermediate_size!r}"
            )
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError(
                f"{where}: shared_gate needs a shared expert (shared_intermediate_size)"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"{where}: capacity_factor must be > 0 or None, got {self.capacity_factor!r}"
            )

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments an expert may take for ``num_tokens`` tokens (None: unlimited)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)


# --------------------------------------------------------------------------- routing
@dataclass
class Routing:
    """One router call over ``N`` tokens."""

    logits: Tensor  # (N, E) fp32 router logits
    probs: Tensor  # (N, E) what the balancing loss weighs: softmax, or normalised sigmoid
    indices: Tensor  # (N, k) chosen experts
    weights: Tensor  # (N, k) their combine weights


class Router(nn.Module):
    """``weight`` (E, C): the router's linear map; ``bias`` (E,), a buffer (sigmoid scoring
    only): the selection bias of auxiliary-loss-free balancing, moved by :meth:`MoE.update_bias`,
    never by a gradient."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))
        nn.init.normal_(self.weight, std=0.02)
        if config.scoring == "sigmoid":
            self.register_buffer("bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.bias = None

    def forward(self, x: Tensor) -> Routing:
        c = self.config
        if c.scoring == "softmax":  # logits in the model's dtype, softmax in fp32 (as HF)
            logits = F.linear(x, self.weight).float()
            probs = torch.softmax(logits, dim=-1)
            weights, indices = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # DeepSeek-V3 routes in fp32
            logits = F.linear(x.float(), self.weight.float())
            scores = torch.sigmoid(logits)
            indices = self._group_limited_topk(scores.detach() + self.bias)
            weights = scores.gather(1, indices)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if c.routed_scaling_factor != 1.0:
            weights = weights * c.routed_scaling_factor
        return Routing(logits, probs, indices, weights.to(x.dtype))

    def _group_limited_topk(self, choice: Tensor) -> Tensor:
        """DeepSeek-V3's selection: keep the ``topk_group`` groups whose two best scores sum
        highest, then the top-k experts among them (HF's ``DeepseekV3TopkRouter``)."""
        c = self.config
        N = choice.shape[0]
        if c.n_group > 1:
            grouped = choice.view(N, c.n_group, c.num_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(N, c.num_experts)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        return torch.topk(choice, k=c.top_k, dim=-1, sorted=False)[1]


# --------------------------------------------------------------------------- statistics
@dataclass
class MoEStats:
    """What one MoE layer measured in its last forward. ``probs`` carries gradients (the
    balancing loss is built from it); the counts are integers without gradients."""

    probs: Tensor  # (N, E)
    indices: Tensor  # (N, k)
    logits: Tensor  # (N, E)
    tokens_per_expert: Tensor  # (E,) assignments routed to each expert (before any drop)
    dropped: Tensor  # (E,) assignments over capacity, dropped

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    def aux_loss(self) -> Tensor:
        """This layer's load-balancing loss ``E · Σ_e f_e · P_e`` (module docstring)."""
        return load_balancing_loss([self], self.indices.shape[-1])

    def z_loss(self) -> Tensor:
        """ST-MoE's router z-loss: ``mean_t logsumexp(logits_t)²``."""
        return torch.logsumexp(self.logits, dim=-1).square().mean()

    def summary(self) -> dict[str, float]:
        """Plain numbers for logging: max / mean load, their ratio, dropped assignments."""
        load = self.tokens_per_expert.float()
        mean = load.mean()
        return {
            "max_load": float(load.max()),
            "mean_load": float(mean),
            "imbalance": float(load.max() / mean) if mean > 0 else 0.0,
            "dropped": float(self.dropped.sum()),
            "dropped_fraction": float(self.dropped.sum() / load.sum()) if load.sum() > 0 else 0.0,
            "aux_loss": float(self.aux_loss().detach()),
            "z_loss": float(self.z_loss().detach()),
        }


def load_balancing_loss(
    stats: list[MoEStats], top_k: int, attention_mask: Tensor | None = None
) -> Tensor:
    """The auxiliary load-balancing loss over the layers ``stats``, as ``transformers``'
    ``load_balancing_loss_func`` computes it: the counts of chosen experts and the router
    probabilities of all layers are pooled, then ``E · Σ_e f_e · P_e`` with
    ``f_e = count_e / rows`` and ``P_e = Σ p_e / rows``. ``attention_mask`` (B, T): padding
    rows count for nothing (the layers' tokens are the (B·T) flattened rows)."""
    if not stats:
        raise ValueError("load_balancing_loss: no MoE layer ran (call the model first)")
    E = stats[0].num_experts
    device = stats[0].probs.device
    counts = torch.zeros(E, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).float().to(device)
    for s in stats:
        chosen = s.indices[:, :top_k].reshape(-1)
        if mask is None:
            counts = counts + torch.bincount(chosen, minlength=E).float()
            prob_sum = prob_sum + s.probs.float().sum(dim=0)
            rows = rows + s.probs.shape[0]
        else:
            counts = counts.scatter_add(0, chosen, mask.repeat_interleave(s.indices.shape[-1]))
            prob_sum = prob_sum + (s.probs.float() * mask[:, None]).sum(dim=0)
            rows = rows + mask.sum()
    return E * torch.sum((counts / rows) * (prob_sum / rows))


# --------------------------------------------------------------------------- experts
class Experts(nn.Module):
    """``num_experts`` gated MLPs with stacked weights: ``gate_proj`` and ``up_proj``
    (E, I, C), ``down_proj`` (E, C, I), each expert's slice laid out as an ``nn.Linear``
    weight (HF's per-expert ``gate_proj/up_proj/down_proj``, Mixtral's ``w1/w3/w2``)."""

    def __init__(self, config: MoEConfig, ops: Any = None) -> None:
        super().__init__()
        E, C, I = config.num_experts, config.dim, config.intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, C))
        self.up_proj = nn.Parameter(torch.empty(E, I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)
        self.swiglu = ops.swiglu if ops is not None else _swiglu

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e``'s MLP on the rows ``x``."""
        h = self.swiglu(x @ self.gate_proj[e].t(), x @ self.up_proj[e].t())
        return h @ self.down_proj[e].t()

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """The grouped path (:meth:`grouped`), called as the module so that what wraps the
        module (FSDP2 gathering the experts' weights) sees it run."""
        return self.grouped(x, counts)

    def grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        """Every expert on its contiguous slice of ``x`` (rows sorted by expert)."""
        h = self.swiglu(
            grouped_matmul(x, self.gate_proj, counts), grouped_matmul(x, self.up_proj, counts)
        )
        return grouped_matmul(h, self.down_proj, counts)


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class SharedMLP(nn.Module):
    """The shared experts: one gated MLP every token goes through (DeepSeek's
    ``n_shared_experts`` experts are one MLP of their summed width)."""

    def __init__(self, dim: int, width: int, ops: Any = None) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, width, bias=False)
        self.up_proj = Linear(dim, width, bias=False)
        self.down_proj = Linear(width, dim, bias=False)
        self.swiglu = ops.swiglu if ops is not None else _swiglu

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))


# --------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """Router + routed experts (+ shared experts): ``(B, T, C) -> (B, T, C)``; what it measured
    is in :attr:`stats` after each forward (module docstring)."""

    def __init__(self, config: MoEConfig, ops: Any = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.router = Router(config)
        self.experts = Experts(config, ops)
        if config.shared_intermediate_size:
            self.shared_expert = SharedMLP(config.dim, config.shared_intermediate_size, ops)
        else:
            self.shared_expert = None
        self.shared_expert_gate = (
            nn.Linear(config.dim, 1, bias=False) if config.shared_gate else None
        )
        self.stats: MoEStats | None = None
        self.expert_fn: Any = None  # set by swap_experts; None: self.experts (grouped)

    def expert_parameters(self) -> dict[str, nn.Parameter]:
        """The routed experts' stacked weights, ``(E, out, in)``, by name under this layer."""
        return {f"experts.{n}": p for n, p in self.experts.named_parameters()}

    def swap_experts(self, wrap: Any) -> int:
        """Replace the expert computation ``fn(x, counts) -> y`` (``x``: rows sorted by expert,
        ``counts[e]`` rows for expert ``e``) by ``wrap(fn)``; returns 1 (the layers changed)."""
        self.expert_fn = wrap(self.expert_fn or self.experts)
        return 1

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        if self.config.implementation == "loop" and self.expert_fn is None:
            out, counts, dropped = self._loop(flat, routing)
        else:
            out, counts, dropped = self._grouped(flat, routing)
        out = out.reshape(shape)
        if self.shared_expert is not None:  # on (B, T, C): tensor parallelism splits T (SP)
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        self.stats = MoEStats(routing.probs, routing.indices, routing.logits, counts, dropped)
        return out

    def _loop(self, x: Tensor, r: Routing) -> tuple[Tensor, Tensor, Tensor]:
        """The reference: per expert, its assignments in token order (the first ``C`` with a
        capacity), its MLP, the weighted result added to its tokens' rows."""
        N, k = r.indices.shape
        E = self.config.num_experts
        capacity = self.config.capacity(N)
        chosen, weights = r.indices.reshape(-1), r.weights.reshape(-1)
        out = torch.zeros_like(x)
        counts = torch.zeros(E, dtype=torch.long, device=x.device)
        dropped = torch.zeros_like(counts)
        for e in range(E):
            slots = torch.nonzero(chosen == e).flatten()  # assignment ids, token-major
            counts[e] = slots.numel()
            if capacity is not None and slots.numel() > capacity:
                dropped[e] = slots.numel() - capacity
                slots = slots[:capacity]
            if slots.numel() == 0:
                continue
            tokens = slots // k
            y = self.experts.expert(e, x[tokens]) * weights[slots, None]
            out.index_add_(0, tokens, y)
        return out, counts, dropped

    def _grouped(self, x: Tensor, r: Routing) -> tuple[Tensor, Tensor, Tensor]:
        """All experts at once over the assignments sorted by expert (module docstring)."""
        N, k = r.indices.shape
        E = self.config.num_experts
        chosen = r.indices.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # assignment ids, grouped by expert
        counts = torch.bincount(chosen, minlength=E)
        kept = counts
        capacity = self.config.capacity(N)
        if capacity is not None:
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=x.device) - starts[chosen[order]]
            order = order[rank < capacity]
            kept = counts.clamp(max=capacity)
        y = (self.expert_fn or self.experts)(dispatch_rows(x, order, k), kept)
        return combine_rows(y, r.weights, order), counts, counts - kept

    # ------------------------------------------------------------------ balancing
    @torch.no_grad()
    def update_bias(self, rate: float, tokens_per_expert: Tensor | None = None) -> Tensor:
        """DeepSeek-V3's auxiliary-loss-free balancing: ``bias_e += rate · sign(mean - load_e)``
        (overloaded experts become less likely to be chosen, underloaded ones more), from
        ``tokens_per_expert`` (default: the last forward's; pass counts summed over the data
        ranks in distributed training). Returns the new bias; no gradient is involved."""
        if self.router.bias is None:
            raise ValueError(
                "update_bias: this layer has no selection bias (scoring='softmax'); "
                "auxiliary-loss-free balancing is for scoring='sigmoid' (DeepSeek-V3)"
            )
        if tokens_per_expert is None:
            if self.stats is None:
                raise ValueError("update_bias: no forward has run yet (no expert load known)")
            tokens_per_expert = self.stats.tokens_per_expert
        load = tokens_per_expert.float().to(self.router.bias.device)
        self.router.bias.add_(rate * torch.sign(load.mean() - load))
        return self.router.bias
