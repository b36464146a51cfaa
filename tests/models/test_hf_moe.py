"""Mixtral, Qwen2-MoE and Qwen3-MoE as configurations of llmlab's Llama: random-initialised
``transformers`` models (no download) saved to folders, loaded with ``from_pretrained`` (per-expert
files) and ``Llama.from_hf`` / a stacked folder (transformers' in-memory layout): logits,
greedy decoding and the auxiliary loss equal HF's; ``save_pretrained`` -> transformers loads it
back equal; what cannot be loaded or exported is refused with the reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llmlab.decoding import generate
from llmlab.models import Llama, LlamaConfig, from_pretrained, save_pretrained
from llmlab.models.hf import CheckpointError
from llmlab.models.moe import MoE
from tests.helpers.hf_tiny import engine_matches_hf_greedy, hf_greedy

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # fp32 logits: the same maths, summed in another order
COMMON = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
)  # fmt: skip
# name -> (transformers family, config overrides)
QWEN = dict(intermediate_size=48, moe_intermediate_size=24, num_experts_per_tok=2)
VARIANTS = {
    "mixtral": ("Mixtral", dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe-renorm-dense-layer": (
        "Qwen3Moe",
        dict(**QWEN, num_experts=8, head_dim=8, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen3-moe-no-renorm": (
        "Qwen3Moe",
        dict(**QWEN, num_experts=4, norm_topk_prob=False, attention_bias=True),
    ),
    "qwen2-moe-shared": (
        "Qwen2Moe",
        dict(**QWEN, num_experts=4, shared_expert_intermediate_size=40, decoder_sparse_step=2),
    ),
}


def _build(family: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**COMMON, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms and biases away from 1 / 0: a mix-up shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for name, (family, overrides) in VARIANTS.items():
        hf = _build(family, overrides)
        hf.save_pretrained(root / name)
        out[name] = (hf, root / name)
    return out


def _ids(seed: int = 0, batch: int = 3, length: int = 13) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_transformers_writes_each_expert_as_its_own_tensors(folders):
    """What the installed transformers saves (it stacks experts in memory only)."""
    from safetensors import safe_open

    _, folder = folders["mixtral"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_pretrained_equals_transformers_and_exports_back(name, folders, tmp_path):
    hf, folder = folders[name]
    ours = from_pretrained(folder).eval()
    assert isinstance(ours, Llama)
    moe = ours.moe_layers()
    expected_layers = {"qwen3-moe-renorm-dense-layer": [0, 2], "qwen2-moe-shared": [1]}
    assert sorted(moe) == expected_layers.get(name, [0, 1, 2])
    ids = _ids()
    with torch.no_grad():
        reference = hf(ids, output_router_logits=True)
        logits = ours(ids)
    torch.testing.assert_close(logits, reference.logits, atol=ATOL, rtol=0)
    # HF's aux loss (output_router_logits=True): within 1e-6
    torch.testing.assert_close(
        ours.router_aux_loss(), reference.aux_loss.float(), atol=1e-6, rtol=1e-6
    )
    prompt = ids[:1, :5]
    hf_tokens = hf_greedy(hf, prompt, 8)
    assert torch.equal(generate(ours, prompt, max_new_tokens=8)[:, 5:], hf_tokens)

    out = save_pretrained(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == hf.config.model_type
    again = from_pretrained(out)
    assert again.config == ours.config
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k  # bit-exact
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, reference.logits, atol=ATOL, rtol=0)


def test_aux_loss_with_padding_equals_transformers(folders):
    """Left-padded rows: the padding's router rows are excluded, as HF excludes them."""
    hf, folder = folders["qwen3-moe-renorm-dense-layer"]
    ours = from_pretrained(folder).eval()
    ids = _ids(1, batch=2, length=9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        reference = hf(ids, attention_mask=mask, output_router_logits=True)
        logits = ours(ids, attention_mask=mask)
    torch.testing.assert_close(logits[1], reference.logits[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0, 4:], reference.logits[0, 4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        ours.router_aux_loss(mask), reference.aux_loss.float(), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe-shared"])
def test_stacked_experts_load_too(name, folders, tmp_path):
    """transformers' own stacked layout (gate_up_proj (E, 2I, C), down_proj (E, C, I)): as
    ``Llama.from_hf`` sees it in memory, and as a folder holding those tensors."""
    from safetensors.torch import save_file

    hf, folder = folders[name]
    ids = _ids(2)
    with torch.no_grad():
        expected = hf(ids).logits
    in_memory = Llama.from_hf(hf).eval()
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["lm_head.weight"] = hf.lm_head.weight.detach().clone()
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    (stacked / "config.json").write_text((folder / "config.json").read_text())
    from_folder = from_pretrained(stacked).eval()
    with torch.no_grad():
        torch.testing.assert_close(in_memory(ids), expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(from_folder(ids), expected, atol=ATOL, rtol=0)


def test_the_whole_model_grouped_equals_loop_with_gradients(folders):
    """The two expert implementations inside the model: logits and every gradient, 1e-6."""
    _, folder = folders["qwen2-moe-shared"]
    grouped = from_pretrained(folder)
    config = dataclasses.replace(grouped.config, moe_implementation="loop")
    loop = Llama(config)
    loop.load_state_dict(grouped.state_dict())
    ids = _ids(3)
    for model in (grouped, loop):
        logits = model(ids)
        (logits.square().mean() + model.router_aux_loss()).backward()
    torch.testing.assert_close(grouped(ids), loop(ids), atol=1e-6, rtol=1e-6)
    for (n, a), (_, b) in zip(grouped.named_parameters(), loop.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_router_telemetry_and_losses_after_a_forward():
    config = LlamaConfig(
        vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=[1],
        capacity_factor=0.5, router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
    )  # fmt: skip
    model = Llama(config)
    assert list(model.moe_layers()) == [1] and not isinstance(model.blocks[0].mlp, MoE)
    with pytest.raises(ValueError, match="have not run a forward"):
        model.router_stats()
    ids = torch.randint(0, 64, (2, 8))
    model(ids)
    stats = model.router_stats()[1]
    assert int(stats.tokens_per_expert.sum()) == 2 * 8 * 2
    capacity = config.moe_config().capacity(16)
    assert torch.equal(stats.dropped, (stats.tokens_per_expert - capacity).clamp(min=0))
    summary = stats.summary()
    assert set(summary) >= {"max_load", "mean_load", "dropped", "aux_loss", "z_loss"}
    expected = 0.01 * model.router_aux_loss() + 0.001 * stats.z_loss()
    torch.testing.assert_close(model.router_loss(), expected)
    # active parameters: a token visits 2 of 4 experts in the one MoE layer
    experts = sum(p.numel() for p in model.blocks[1].mlp.experts.parameters())
    assert model.active_params() == model.num_params() - experts // 2


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(router_scoring="sigmoid"), "multi-head latent attention"),
        (dict(capacity_factor=1.0), "capacity_factor=1.0 drops tokens"),
        (dict(norm_topk_prob=False), "Mixtral's layout"),
        (dict(shared_expert_intermediate_size=16), "ungated shared expert"),
    ],
)
def test_export_refuses_a_mixture_no_transformers_class_computes(change, reason, tmp_path):
    config = LlamaConfig(
        vocab_size=64, n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, **change,
    )  # fmt: skip
    with pytest.raises(ValueError, match=reason):
        save_pretrained(Llama(config), tmp_path / "out")


def test_refused_moe_fields(folders, tmp_path):
    import shutil

    _, folder = folders["mixtral"]
    shutil.copytree(folder, tmp_path / "jitter")
    config = json.loads((tmp_path / "jitter" / "config.json").read_text())
    config["router_jitter_noise"] = 0.1
    (tmp_path / "jitter" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"router_jitter_noise=0\.1 is not supported"):
        from_pretrained(tmp_path / "jitter")


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe-shared"])
def test_the_serving_engine_decodes_like_transformers(name, folders):
    """Three prompts batched through the paged engine (continuous batching, 4-token blocks):
    each request's greedy tokens are HF ``generate``'s on that prompt alone."""
    hf, folder = folders[name]
    ids = _ids(4, batch=3, length=9)
    prompts = [ids[0, :9].tolist(), ids[1, :5].tolist(), ids[2, :7].tolist()]
    engine_matches_hf_greedy(from_pretrained(folder).eval(), hf, prompts, 10)
