"""An :class:`~llmlab.parallel.data.fsdp2.FSDP2Engine`'s state as full tensors by name: the
consolidated checkpoint's view of FSDP2, the counterpart of :mod:`.zero_state`'s for llmlab's
engine (same names, same shapes), so a consolidated checkpoint of either implementation loads
into the other. The sharded format needs nothing here: the engine lists its pieces like
llmlab's does and :class:`~.layout_state.LayoutState` writes both alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from llmlab.parallel.data.fsdp2 import FSDP2Engine, as_dtensor_like, local_rows


@torch.no_grad()
def fsdp2_full_params(engine: FSDP2Engine) -> dict[str, Tensor]:
    """Every parameter in full (its tensor-parallel slice), by name: a collective."""
    engine.refresh_params()
    return {n: p.full_tensor() for n, p in engine.named_params()}


@torch.no_grad()
def load_fsdp2_full_params(engine: FSDP2Engine, values: Mapping[str, Tensor]) -> None:
    """Each rank copies its rows of ``values`` (full tensors by name) into its shards."""
    missing = [n for n, _ in engine.named_params() if n not in values]
    if missing:
        raise KeyError(f"no value for {len(missing)} parameters, e.g. {missing[:4]}")
    engine.refresh_params()
    for name, p in engine.named_params():
        p.to_local().copy_(local_rows(values[name].to(p.dtype), p))


def fsdp2_full_optimizer_state(
    engine: FSDP2Engine, optimizer: Optimizer
) -> dict[str, dict[str, Any]]:
    """``optimizer``'s state by parameter name at full shape (element-wise state gathered, a
    collective; scalars as they are: equal on every rank)."""
    return {
        name: {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}
        for name, p in engine.named_params()
        if (state := optimizer.state.get(p))
    }


@torch.no_grad()
def load_fsdp2_full_optimizer_state(
    engine: FSDP2Engine, optimizer: Optimizer, state: Mapping[str, Mapping[str, Any]]
) -> None:
    """The inverse: each parameter's element-wise state as ``DTensor`` rows placed like it."""
    for name, p in engine.named_params():
        saved = state.get(name)
        if saved is None:
            continue
        optimizer.state[p] = {
            k: (
                as_dtensor_like(local_rows(v, p).to(p.device).clone(), p)
                if isinstance(v, Tensor) and v.shape == p.shape and v.dim() > 0
                else (v.clone() if isinstance(v, Tensor) else v)
            )
            for k, v in saved.items()
        }
