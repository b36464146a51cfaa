"""No buffer in ``llmlab.parallel`` is allocated on a hard-coded device (issue 15, done-when 3).

Every strategy's gradient buffers are built for parameters on the ``meta`` device, and every
buffer must land there too: a buffer that names ``cpu`` (or takes torch's default device) would
land on the CPU instead, the bug that kept the bucketed data-parallel strategy off NCCL (defect
4). Built, not run: a collective cannot move meta tensors, so where one would run, the test
records the device of the tensor handed to it instead.

Covered: bucketed DP (``GradientBucketer``), the parameter server (the push message packed on
the parameters' device; its wire copy is host memory on purpose: its group is gloo), the
pipeline / N-D reducer (``GradientReducer`` and ``all_reduce_mean_``), ZeRO 1/2/3
(``ZeroEngine``'s flat parameters, shards, masters, gradient shards and buffers).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_distributed


def _meta_model() -> nn.Module:
    from llmlab.models import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _devices_of(obj, prefix: str = "") -> dict[str, torch.device]:
    """Every tensor reachable from a buffer-holding object's attributes, by name."""
    from llmlab.parallel.buffers import FlatBuffer

    out: dict[str, torch.device] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.device
    elif isinstance(obj, FlatBuffer):
        out[f"{prefix}.data"] = obj.data.device
    elif isinstance(obj, list | tuple):
        for i, x in enumerate(obj):
            out.update(_devices_of(x, f"{prefix}[{i}]"))
    elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
        for k, v in vars(obj).items():
            holds = isinstance(v, torch.Tensor | FlatBuffer | list | tuple) or hasattr(
                v, "__dict__"
            )
            if holds and not isinstance(v, nn.Module) and not callable(v):
                out.update(_devices_of(v, f"{prefix}.{k}"))
    return out


def _build_all(rank: int, world: int) -> dict[str, dict[str, str]]:
    import torch.distributed as dist

    from llmlab.parallel.buffers import all_reduce_mean_
    from llmlab.parallel.data.bucketed import GradientBucketer
    from llmlab.parallel.data.parameter_server import ParameterServerStrategy, assign_shards
    from llmlab.parallel.data.zero import ZeroEngine
    from llmlab.parallel.pipeline.grad_sync import GradientReducer

    found: dict[str, dict[str, str]] = {}
    handed: list[torch.device] = []
    real_all_reduce = dist.all_reduce

    def record(tensor, *args, **kwargs):  # stands in for the collective on meta tensors
        handed.append(tensor.device)

    def strs(d: dict) -> dict[str, str]:
        return {k: str(v) for k, v in d.items()}

    # bucketed data parallel
    model = _meta_model()
    bucketer = GradientBucketer(model.parameters(), 0.001, "torch", group=None)
    found["bucketed"] = strs({f"bucket{b.index}": b.buffer.data.device for b in bucketer.buckets})
    assert len(bucketer.buckets) > 1  # a 1 KB cap: several buckets
    bucketer.close()

    # parameter server: the push message of every server
    ps = ParameterServerStrategy(num_servers=2)
    ps._params = [p for p in _meta_model().parameters()]
    ps._shards = assign_shards([p.numel() for p in ps._params], 2)
    ps._versions = [0, 0]
    found["parameter_server"] = strs({f"push{s}": ps._push_message(s).data.device for s in (0, 1)})

    # pipeline / N-D reducer: zero-filled missing grads and the flat all-reduce buffer
    params = list(_meta_model().parameters())
    dist.all_reduce = record
    try:
        GradientReducer(params=params, data_size=2)()
        all_reduce_mean_([p.grad for p in params], None, size=2)
    finally:
        dist.all_reduce = real_all_reduce
    found["reducer"] = strs({f"grad{i}": p.grad.device for i, p in enumerate(params)})
    found["reducer"].update({f"collective{i}": str(d) for i, d in enumerate(handed)})

    # ZeRO 1, 2, 3
    for stage in (1, 2, 3):
        model = _meta_model()
        engine = ZeroEngine(model, stage, prefetch=False)
        devices: dict[str, torch.device] = {}
        for unit in engine.units:
            devices.update(_devices_of(unit, f"unit{unit.index}"))
        found[f"zero{stage}"] = strs(devices)
    return found


@pytest.mark.distributed
def test_every_strategy_builds_its_buffers_on_the_parameters_device() -> None:
    (found,) = run_distributed(_build_all, 1, timeout=300)
    for strategy in ("bucketed", "parameter_server", "reducer", "zero1", "zero2", "zero3"):
        devices = found[strategy]
        assert devices, strategy  # something was built and inspected
        elsewhere = {k: v for k, v in devices.items() if v != "meta"}
        assert not elsewhere, (strategy, elsewhere)
    assert any(k.startswith("collective") for k in found["reducer"])
    assert any(".grad_shard" in k for k in found["zero2"]), found["zero2"]
