"""The MoE layer (llmlab.models.moe): the grouped path against the per-expert loop (forward and
every gradient), the routers and blocks against transformers' on the same weights, the
load-balancing loss against HF's ``load_balancing_loss_func``, capacity drops counted, the
auxiliary-loss-free bias update."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmlab.models.moe import MoE, MoEConfig, load_balancing_loss
from llmlab.models.moe_dispatch import grouped_matmul, segment_matmul

transformers = pytest.importorskip("transformers")

# Widths that are multiples of 4 fp32 values: grouped_mm's 16-byte rows.
BASE = MoEConfig(dim=32, num_experts=8, top_k=2, intermediate_size=24)
VARIANTS = {
    "softmax-renorm (Mixtral, Qwen3-MoE)": BASE,
    "softmax-no-renorm (Qwen2-MoE) + gated shared": dataclasses.replace(
        BASE, norm_topk_prob=False, shared_intermediate_size=40, shared_gate=True
    ),
    "sigmoid-groups (DeepSeek-V3)": dataclasses.replace(
        BASE,
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        top_k=3,
        routed_scaling_factor=2.5,
        shared_intermediate_size=16,
    ),
    "capacity 0.5": dataclasses.replace(BASE, capacity_factor=0.5),
}


def _pair(config: MoEConfig, seed: int = 0) -> tuple[MoE, MoE]:
    torch.manual_seed(seed)
    grouped = MoE(dataclasses.replace(config, implementation="grouped"))
    with torch.no_grad():
        grouped.router.weight.normal_(std=0.5)  # routing far from uniform: uneven loads
        if grouped.router.bias is not None:
            grouped.router.bias.copy_(torch.linspace(-0.1, 0.1, config.num_experts))
    loop = MoE(dataclasses.replace(config, implementation="loop"))
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


def _same_forward_and_gradients(a, b, params_a: MoE, params_b: MoE) -> None:
    """``a`` and ``b`` (layers, or a compiled layer) on the same input: outputs, the input's
    gradient and every parameter's gradient (of ``params_a`` / ``params_b``) within 1e-6."""
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-6, rtol=1e-6)
    pairs = zip(params_a.named_parameters(), params_b.named_parameters(), strict=True)
    for (n, pa), (_, pb) in pairs:
        assert pa.grad is not None, n
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_grouped_path_equals_the_per_expert_loop_forward_and_every_gradient(name):
    """Tolerance 1e-6: the same products, summed in a different order (per slot vs per
    expert)."""
    grouped, loop = _pair(VARIANTS[name])
    _same_forward_and_gradients(grouped, loop, grouped, loop)
    for field in ("tokens_per_expert", "dropped"):
        assert torch.equal(getattr(grouped.stats, field), getattr(loop.stats, field))


def test_grouped_path_under_cpu_autocast_runs_in_the_residual_dtype():
    """bf16-mixed training on CPU: the combine (an autograd function) keeps the residual's dtype
    under autocast and its backward runs. Close to the loop, not equal: autocast runs the
    loop's per-expert matmuls in bf16, and ``grouped_mm`` is not on autocast's list."""
    grouped, loop = _pair(BASE)
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(1))
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yg, yl = grouped(xg), loop(xl)
    assert yg.dtype == yl.dtype == torch.float32
    torch.testing.assert_close(yg, yl, atol=1e-3, rtol=2e-2)
    yg.sum().backward()
    yl.sum().backward()
    assert xg.grad.dtype == torch.float32
    torch.testing.assert_close(xg.grad, xl.grad, atol=1e-3, rtol=2e-2)


def test_segment_fallback_equals_grouped_mm():
    """The fallback for rows grouped_mm cannot take (and torches without it) computes the same."""
    torch.manual_seed(0)
    w = torch.randn(4, 12, 8)
    x = torch.randn(10, 8)
    counts = torch.tensor([3, 0, 5, 2])
    torch.testing.assert_close(
        grouped_matmul(x, w, counts), segment_matmul(x, w, counts.tolist()), atol=1e-6, rtol=0
    )
    odd = MoEConfig(dim=6, num_experts=4, top_k=2, intermediate_size=5)  # rows of 24/20 bytes
    grouped, loop = _pair(odd)
    x = torch.randn(2, 7, 6)
    torch.testing.assert_close(grouped(x), loop(x), atol=1e-6, rtol=1e-6)


def test_a_compiled_layer_equals_the_eager_one_forward_and_every_gradient():
    """``torch.compile`` of the layer (``compile=true`` compiles the blocks around it): in fp32
    on CPU ``grouped_mm``'s shape function refuses anything but bf16, so inside a compiled
    graph the experts run as per-expert products (the fallback); the same sums as eager's.
    ``aot_eager``: dynamo's tracing and autograd's, no C++ build."""
    torch._dynamo.reset()
    eager, _ = _pair(VARIANTS["softmax-no-renorm (Qwen2-MoE) + gated shared"])
    layer = MoE(eager.config)  # the same layer, another copy to compile
    layer.load_state_dict(eager.state_dict())
    _same_forward_and_gradients(torch.compile(layer, backend="aot_eager"), eager, layer, eager)


def test_capacity_drops_are_counted_and_contribute_nothing():
    config = dataclasses.replace(BASE, capacity_factor=0.5)
    grouped, _ = _pair(config)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2))
    y = grouped(x)
    s = grouped.stats
    N = 32
    capacity = config.capacity(N)
    assert capacity == 4  # ceil(0.5 * 32 * 2 / 8)
    assert int(s.tokens_per_expert.sum()) == N * config.top_k
    assert torch.equal(s.dropped, (s.tokens_per_expert - capacity).clamp(min=0))
    assert int(s.dropped.sum()) > 0
    assert s.summary()["dropped"] == float(s.dropped.sum())
    # the same layer without a capacity, with the dropped assignments' weights zeroed by hand
    free = MoE(dataclasses.replace(config, capacity_factor=None, implementation="loop"))
    free.load_state_dict(grouped.state_dict())
    flat = x.reshape(N, -1)
    routing = free.router(flat)
    chosen = routing.indices.reshape(-1)
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    for e in range(config.num_experts):
        keep[torch.nonzero(chosen == e).flatten()[:capacity]] = True
    expected = torch.zeros_like(flat)
    for a in torch.nonzero(keep).flatten().tolist():
        t, e = a // config.top_k, int(chosen[a])
        expected[t] += routing.weights.reshape(-1)[a] * free.experts.expert(e, flat[t : t + 1])[0]
    torch.testing.assert_close(y.reshape(N, -1), expected, atol=1e-6, rtol=1e-6)
    # a capacity that holds every assignment drops nothing and changes nothing
    roomy = MoE(dataclasses.replace(config, capacity_factor=float(config.num_experts)))
    roomy.load_state_dict(grouped.state_dict())
    free_grouped = MoE(dataclasses.replace(config, capacity_factor=None))
    free_grouped.load_state_dict(grouped.state_dict())
    torch.testing.assert_close(roomy(x), free_grouped(x), atol=0, rtol=0)
    assert int(roomy.stats.dropped.sum()) == 0


# --------------------------------------------------------------------------- against HF
def _hf_block(kind: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    if kind == "mixtral":
        hf_config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                                  num_experts_per_tok=2)  # fmt: skip
        ours = BASE
        block = MixtralSparseMoeBlock(hf_config)
    elif kind == "qwen2_moe":
        hf_config = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=False,
                                   shared_expert_intermediate_size=40)  # fmt: skip
        ours = VARIANTS["softmax-no-renorm (Qwen2-MoE) + gated shared"]
        block = Qwen2MoeSparseMoeBlock(hf_config)
    else:
        hf_config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8,
                                     num_experts_per_tok=3, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5, n_shared_experts=1,
                                     norm_topk_prob=True)  # fmt: skip
        ours = dataclasses.replace(
            VARIANTS["sigmoid-groups (DeepSeek-V3)"], shared_intermediate_size=24
        )
        block = DeepseekV3MoE(hf_config)
    torch.manual_seed(3)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block, ours


def _copy_from_hf(block, ours: MoEConfig) -> MoE:
    moe = MoE(ours)
    I = ours.intermediate_size
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        gate_up = block.experts.gate_up_proj
        moe.experts.gate_proj.copy_(gate_up[:, :I])
        moe.experts.up_proj.copy_(gate_up[:, I:])
        moe.experts.down_proj.copy_(block.experts.down_proj)
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        if shared is not None:
            for p in ("gate_proj", "up_proj", "down_proj"):
                getattr(moe.shared_expert, p).weight.copy_(getattr(shared, p).weight)
        if getattr(block, "shared_expert_gate", None) is not None:
            moe.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
            moe.router.bias.copy_(block.gate.e_score_correction_bias)
    return moe


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("implementation", ["grouped", "loop"])
def test_block_and_router_equal_transformers_on_the_same_weights(kind, implementation):
    """fp32, tolerance 1e-5 (HF's eager per-expert loop sums in another order)."""
    block, ours = _hf_block(kind)
    moe = _copy_from_hf(block, dataclasses.replace(ours, implementation=implementation))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = block(x.clone())
        got = moe(x)
        _, hf_weights, hf_indices = block.gate(x.reshape(-1, 32))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the chosen experts and their weights, compared as sets per token (topk order is free)
    ours_i, order = moe.stats.indices.sort(dim=-1)
    hf_i, hf_order = hf_indices.sort(dim=-1)
    assert torch.equal(ours_i, hf_i)
    routing = moe.router(x.reshape(-1, 32))
    torch.testing.assert_close(
        routing.weights.gather(1, routing.indices.sort(dim=-1)[1]),
        hf_weights.gather(1, hf_order).to(routing.weights.dtype),
        atol=1e-6,
        rtol=1e-6,
    )
    assert order.shape == hf_order.shape


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    """Two layers pooled as HF pools them (not the mean of per-layer losses); tolerance 1e-6."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [_pair(BASE, seed)[0] for seed in (5, 6)]
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    for layer in layers:
        layer(x)
    stats = [layer.stats for layer in layers]
    logits = tuple(s.logits for s in stats)
    expected = load_balancing_loss_func(logits, 8, 2, mask if masked else None)
    got = load_balancing_loss(stats, 2, mask if masked else None)
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=1e-6)
    single = load_balancing_loss_func(logits[:1], 8, 2)
    torch.testing.assert_close(stats[0].aux_loss(), single.float(), atol=1e-6, rtol=1e-6)
    # the loss has a gradient into the router (it is what balancing trains)
    got.backward()
    assert layers[0].router.weight.grad is not None
    assert layers[0].router.weight.grad.abs().sum() > 0


def test_z_loss_and_summary():
    moe, _ = _pair(BASE)
    moe(torch.randn(5, 32))
    s = moe.stats
    expected = (torch.logsumexp(s.logits, -1) ** 2).mean()
    torch.testing.assert_close(s.z_loss(), expected)
    summary = s.summary()
    load = s.tokens_per_expert.float()
    assert summary["max_load"] == float(load.max())
    assert summary["mean_load"] == pytest.approx(5 * 2 / 8)
    assert summary["imbalance"] == pytest.approx(float(load.max() / load.mean()))
    assert summary["dropped"] == 0.0


def test_bias_update_moves_toward_balance_without_gradient():
    config = VARIANTS["sigmoid-groups (DeepSeek-V3)"]
    moe, _ = _pair(config)
    moe(torch.randn(64, 32))
    load = moe.stats.tokens_per_expert.float()
    before = moe.router.bias.clone()
    after = moe.update_bias(0.01).clone()
    step = after - before
    assert not moe.router.bias.requires_grad
    assert "router.bias" in moe.state_dict()  # saved with the model
    expected = torch.where(load > load.mean(), -0.01, torch.where(load < load.mean(), 0.01, 0.0))
    torch.testing.assert_close(step, expected, atol=1e-7, rtol=0)  # fp32 bias: rounding only
    counts = torch.arange(8)
    moe.update_bias(0.5, counts)  # counts from the caller (summed over data ranks)
    assert moe.router.bias[0] > after[0] and moe.router.bias[7] < after[7]
    softmax, _ = _pair(BASE)
    with pytest.raises(ValueError, match="scoring='softmax'"):
        softmax.update_bias(0.01)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
        (dict(scoring="relu"), "scoring='relu'"),
        (dict(n_group=3, scoring="sigmoid"), "n_group=3 equal groups"),
        (dict(n_group=4), "scoring='sigmoid'"),
        (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(shared_gate=True), "shared_gate needs a shared expert"),
        (dict(implementation="fast"), "implementation='fast'"),
    ],
)
def test_bad_configs_are_refused_naming_the_value(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoE(dataclasses.replace(BASE, **change))
