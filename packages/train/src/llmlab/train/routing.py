"""The routing losses of a mixture-of-experts model, added to the loss the task differentiates,
over the whole global batch on any data-parallel layout.

**What is added** (``CausalLMTask.training_step``): ``router_aux_loss_coef · aux +
router_z_loss_coef · z``, with the coefficients the model's config holds (a Mixtral checkpoint's
``config.json`` says ``router_aux_loss_coef: 0.02``; a model from scratch sets them under
``model.``); ``train/loss`` stays the token-mean cross-entropy and ``aux`` is logged on its own
as ``train/aux_loss`` (``z`` as ``train/z_loss`` when its coefficient is set).

* ``aux``, the load-balancing loss of Switch / HF's ``load_balancing_loss_func``, pools every
  MoE layer and every token of the batch: ``E · Σ_e (c_e / R) · (P_e / R)`` with ``c_e`` the
  top-k assignments to expert ``e`` and ``P_e`` the sum of its router probabilities over all
  ``R`` (layer, token) rows. It is a product of two sums over the batch, not a mean over
  tokens, so the mean of each data rank's own ``aux`` is *not* one process's. Here each rank
  sums its rows, then ``c`` and ``R`` are all-reduced over the loss replicas (plain counts)
  and ``P`` with :func:`llmlab.parallel.loss_mean.replica_sum` (differentiable: each rank's
  sums receive ``replicas × ∂aux/∂P``, which the strategy's mean over the replicas turns into
  one process's gradient). One all-reduce per step carries all of it.
* ``z``, ST-MoE's router z-loss ``mean_t logsumexp(s_t)²`` per layer, then the mean over layers,
  is a mean over tokens: its per-layer sums travel in the same all-reduce.

Padding rows count like any other (HF's loss without an ``attention_mask``): the inputs of a
packed pre-training batch have none.

**Auxiliary-loss-free balancing** (DeepSeek-V3, ``task.update_bias_rate`` γ > 0): after each
optimizer step every MoE layer's selection bias moves by ``γ · sign(mean load - load_e)``
(:class:`RebalancesExperts`), the loads being the step's tokens per expert summed over its
micro-batches and over the loss replicas (:class:`BiasUpdate`), so every rank moves its copy of
the bias alike and as one process would.

Only models that route tokens (:class:`BalancesExperts`, met by ``llmlab.models.Llama``) and
whose forward ran MoE layers on this rank take part; a pipeline stage's layers are only a part
of the pool, so the app refuses routing losses with pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from llmlab.parallel.loss_mean import LossReplicas, replica_sum


@runtime_checkable
class BalancesExperts(Protocol):
    """A mixture-of-experts model: each MoE layer's last-forward statistics by layer index
    (``probs`` (N, E), ``indices`` (N, k), ``logits`` (N, E): ``llmlab.models.moe.MoEStats``),
    and the weights of the two routing losses."""

    def router_stats(self) -> dict[int, Any]: ...

    def router_loss_coefficients(self) -> tuple[float, float]: ...


@dataclass(frozen=True)
class RouterLoss:
    """What the task adds (``total``, differentiable) and logs (``aux``, ``z``, detached)."""

    total: Tensor
    aux: Tensor
    z: Tensor | None


def router_loss(model: Any, replicas: LossReplicas) -> RouterLoss | None:
    """The weighted routing losses of ``model``'s last forward over the global batch whose
    tokens ``replicas`` split (module docstring); ``None`` for a model without routers or with
    both coefficients 0."""
    if not isinstance(model, BalancesExperts):
        return None
    aux_coef, z_coef = model.router_loss_coefficients()
    if not (aux_coef or z_coef):
        return None
    stats = list(model.router_stats().values())
    if not stats:
        return None
    E = stats[0].probs.shape[-1]
    device = stats[0].probs.device
    counts = torch.zeros(E, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
    z_sums = []
    for s in stats:
        counts = counts + torch.bincount(s.indices.reshape(-1), minlength=E).float()
        prob_sum = prob_sum + s.probs.float().sum(dim=0)
        z_sums.append(torch.logsumexp(s.logits.float(), dim=-1).square().sum())
    rows = torch.tensor([float(s.probs.shape[0]) for s in stats], device=device)
    L = len(stats)
    pooled = replica_sum(torch.cat([prob_sum, torch.stack(z_sums), counts.detach(), rows]),
                         replicas)  # fmt: skip
    prob_sum, z_sums, counts, rows = pooled.split([E, L, E, L])
    total_rows = rows.sum()
    aux = E * torch.sum((counts / total_rows) * (prob_sum / total_rows))
    z = (z_sums / rows).mean()
    total = aux_coef * aux + (z_coef * z if z_coef else 0.0)
    return RouterLoss(total, aux.detach(), z.detach() if z_coef else None)


@runtime_checkable
class RebalancesExperts(Protocol):
    """A mixture-of-experts model with selection biases (sigmoid routing, DeepSeek-V3) that
    auxiliary-loss-free balancing moves: ``update_router_bias(rate, tokens_per_expert)``."""

    def router_stats(self) -> dict[int, Any]: ...

    def update_router_bias(self, rate: float, tokens_per_expert: dict[int, Tensor]) -> None: ...


class BiasUpdate:
    """Counts a step's tokens per expert (:meth:`add`, after each micro-batch's forward) and
    moves the biases once the optimizer has stepped (:meth:`apply`; module docstring)."""

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ValueError(f"task.update_bias_rate must be > 0 to balance, got {rate!r}")
        self.rate = rate
        self.counts: dict[int, Tensor] = {}

    def add(self, model: Any) -> None:
        if not isinstance(model, RebalancesExperts):
            raise ValueError(
                f"task.update_bias_rate={self.rate}: {type(model).__name__} has no router "
                "selection bias to move (update_router_bias); leave the option out"
            )
        for i, s in model.router_stats().items():
            load = s.tokens_per_expert.detach().to(torch.float64)
            self.counts[i] = self.counts[i] + load if i in self.counts else load

    def apply(self, model: Any, replicas: LossReplicas) -> None:
        if not self.counts:
            return
        layers = sorted(self.counts)
        loads = torch.stack([self.counts[i] for i in layers])
        loads = replica_sum(loads, replicas)  # plain counts: no gradient
        model.update_router_bias(self.rate, dict(zip(layers, loads.unbind(0), strict=True)))
        self.counts = {}
