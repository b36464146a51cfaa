"""DeepSeek-V3 as a configuration of llmlab's Llama (multi-head latent attention, YaRN and
interleaved RoPE, dense first layers, sigmoid routing with the e_score_correction_bias, shared
experts), and YaRN for every family: random-initialised ``transformers`` models (no download),
saved to folders and loaded with ``from_pretrained``; logits, greedy decoding (KV cache) and the
router's choices equal HF's; ``save_pretrained`` -> transformers loads it back equal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmlab.decoding import generate
from llmlab.models import Llama, LlamaConfig, from_pretrained, save_pretrained
from llmlab.models.hf import CheckpointError
from llmlab.models.llama_layers import LatentAttention
from llmlab.models.rope import Rotary, attention_factor, inverse_frequencies, softmax_scale
from tests.helpers.hf_tiny import engine_matches_hf_greedy, hf_greedy

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # fp32 logits: the same maths, summed in another order
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0,
}  # fmt: skip
DEEPSEEK = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
    initializer_range=0.1,
)  # fmt: skip
VARIANTS = {
    # DeepSeek-V3's shape: q bottleneck, interleaved YaRN RoPE, 1 dense layer, then 8 experts in
    # 4 groups (2 groups eligible), top-3, 2 shared experts, routed_scaling_factor 2.5
    "v3-yarn-qlora-moe": dict(
        q_lora_rank=24, v_head_dim=12, rope_parameters=YARN, n_routed_experts=8,
        n_shared_experts=2, n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    # no q bottleneck, rotate-half RoPE, v wider than q/k (the padding goes the other way),
    # every layer dense, no renormalisation
    "dense-plain-q-wide-v": dict(
        q_lora_rank=None, v_head_dim=32, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, n_routed_experts=4,
        first_k_dense_replace=3, n_group=1, topk_group=1,
    ),
    # ... and attention biases (q_a, kv_a, o)
    "no-renorm-one-group-biases": dict(
        q_lora_rank=24, v_head_dim=12, rope_parameters=YARN, n_routed_experts=4,
        attention_bias=True, n_shared_experts=1, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False,
    ),
}  # fmt: skip


def _build(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **overrides})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from 1 / 0: a mix-up shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():  # a selection bias that changes the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    out = {}
    for name, overrides in VARIANTS.items():
        hf = _build(overrides)
        hf.save_pretrained(root / name)
        out[name] = (hf, root / name)
    return out


def _ids(seed: int = 0, batch: int = 3, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- YaRN
@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0, original_max_position_embeddings=32),
        dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
        dict(factor=4.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.707),
        dict(factor=40.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.8),
        dict(factor=2.0, original_max_position_embeddings=32, attention_factor=0.9, truncate=False),
    ],
)
def test_yarn_frequencies_and_scales_equal_transformers(params):
    from transformers.modeling_rope_utils import _compute_yarn_parameters, yarn_apply_mscale

    scaling = {"rope_type": "yarn", **params}
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=128,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )  # fmt: skip
    inv_freq, factor = _compute_yarn_parameters(config)
    torch.testing.assert_close(
        inverse_frequencies(32, 10000.0, scaling, torch.device("cpu")), inv_freq, atol=0, rtol=0
    )
    assert attention_factor(scaling) == pytest.approx(factor, rel=1e-15)
    assert softmax_scale(scaling, 24) == pytest.approx(
        yarn_apply_mscale(scaling, 24**-0.5), rel=1e-15
    )
    # the cos / sin tables, attention factor included, equal HF's rotary embedding's
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(100)[None]
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    ours_cos, ours_sin = Rotary(32, 10000.0, scaling)(positions, torch.float32)
    torch.testing.assert_close(torch.cat((ours_cos, ours_cos), -1), cos, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat((ours_sin, ours_sin), -1), sin, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_yarn_on_a_llama_family_model_equals_transformers(family, tmp_path):
    """YaRN is no longer refused for Llama / Qwen configs: logits and greedy decoding equal
    HF's, and the export loads back in transformers with the same logits."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters={**YARN, "mscale": 0.9}, initializer_range=0.1,
    )  # fmt: skip
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    ids = _ids(length=100)  # past the original 32 positions
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=ATOL, rtol=0)
    prompt = ids[:1, :6]
    assert torch.equal(generate(ours, prompt, max_new_tokens=8)[:, 6:], hf_greedy(hf, prompt, 8))
    out = save_pretrained(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- DeepSeek-V3
@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_pretrained_equals_transformers_and_exports_back(name, folders, tmp_path):
    hf, folder = folders[name]
    ours = from_pretrained(folder).eval()
    assert isinstance(ours, Llama)
    assert all(isinstance(b.attn, LatentAttention) for b in ours.blocks)
    first_dense = hf.config.first_k_dense_replace
    assert sorted(ours.moe_layers()) == list(range(first_dense, 3))
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=ATOL, rtol=0)

    out = save_pretrained(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    again = from_pretrained(out)
    assert again.config == ours.config
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k  # bit-exact
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_decoding_through_the_kv_cache_equals_transformers_generate(name, folders):
    hf, folder = folders[name]
    ours = from_pretrained(folder).eval()
    prompt = _ids(1, batch=2, length=7)
    expected = torch.cat([hf_greedy(hf, prompt[i : i + 1], 12) for i in range(2)])
    assert torch.equal(generate(ours, prompt, max_new_tokens=12)[:, 7:], expected)
    # the cache holds the compressed latent, once: kv_lora_rank + qk_rope_head_dim per token
    cache = ours.new_cache(2, 32)
    assert cache.keys[0].shape == (2, 1, 32, 16 + 8) and cache.values is cache.keys
    assert cache.nbytes == 3 * 2 * 32 * 24 * 4
    # beam search reorders the cache: the shared buffer stays shared and right
    beams = generate(ours, prompt[:1], max_new_tokens=6, num_beams=3)
    hf.generation_config.eos_token_id = None
    expected = hf.generate(prompt[:1], attention_mask=torch.ones_like(prompt[:1]),
                           max_new_tokens=6, num_beams=3, do_sample=False)  # fmt: skip
    assert torch.equal(beams, expected)


def test_left_padded_batch_equals_transformers(folders):
    hf, folder = folders["v3-yarn-qlora-moe"]
    ours = from_pretrained(folder).eval()
    ids = _ids(2, batch=2, length=11)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        logits = ours(ids, attention_mask=mask)
    torch.testing.assert_close(logits[1], expected[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0, 4:], expected[0, 4:], atol=ATOL, rtol=0)


def test_router_chooses_the_experts_and_weights_of_transformers(folders):
    """HF returns no aux loss for DeepSeek-V3: the router's choices are compared instead."""
    hf, folder = folders["v3-yarn-qlora-moe"]
    ours = from_pretrained(folder).eval()
    seen = {}

    def keep(layer):
        def hook(module, args, output):
            seen[layer] = (args[0].detach(), output)

        return hook

    handles = [hf.model.layers[i].mlp.gate.register_forward_hook(keep(i)) for i in (1, 2)]
    with torch.no_grad():
        hf(_ids(3))
    for h in handles:
        h.remove()
    for i, (x, (_, hf_weights, hf_indices)) in seen.items():
        routing = ours.blocks[i].mlp.router(x.reshape(-1, x.shape[-1]))
        mine = routing.indices.sort(dim=-1)
        theirs = hf_indices.sort(dim=-1)
        assert torch.equal(mine.values, theirs.values), i
        torch.testing.assert_close(
            routing.weights.gather(1, mine.indices), hf_weights.gather(1, theirs.indices),
            atol=1e-6, rtol=1e-6,
        )  # fmt: skip
    # the selection bias is the checkpoint's e_score_correction_bias, kept in fp32
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.blocks[1].mlp.router.bias, bias)


def test_in_memory_stacked_experts_load_too(folders):
    """``Llama.from_hf``: transformers' in-memory layout (gate_up_proj stacked)."""
    hf, _ = folders["v3-yarn-qlora-moe"]
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    ours = Llama.from_hf(hf).eval()
    ids = _ids(4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_training_path_equals_the_cache_path_and_has_gradients():
    """Latent attention with no context (training) and through a KV cache agree; every
    parameter gets a gradient."""
    config = LlamaConfig(
        vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=4, intermediate_size=48,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        rope_interleave=True, rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_scoring="sigmoid",
        shared_expert_intermediate_size=16, moe_layers=[1],
    )  # fmt: skip
    model = Llama(config)
    ids = torch.randint(0, 64, (2, 9))
    logits = model(ids)
    logits.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == [] or all("router" in n for n in missing), missing
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        stepped = torch.cat(
            [model(ids[:, :5], attention=cache), model(ids[:, 5:], attention=cache)], 1
        )
    torch.testing.assert_close(stepped, logits.detach(), atol=1e-5, rtol=0)
    # the fixed-shape step torch.compile runs (decoding's compile=True) writes the same latent
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        model(ids[:, :8], attention=cache)
        key_mask = torch.arange(16)[None].expand(2, -1) <= 8
        step = cache.static_step(torch.tensor([8]), key_mask)
        last = model(ids[:, 8:], positions=torch.full((2, 1), 8), attention=step)
    torch.testing.assert_close(last[:, 0], logits.detach()[:, 8], atol=1e-5, rtol=0)


@pytest.mark.parametrize("wrap", ["int8", "lora"])
def test_the_latent_path_reads_quantized_and_lora_projections(wrap, folders):
    """The absorbed order reads kv_b_proj as a matrix (``dense_weight``): a quantized layer's
    dequantized weight, a LoRA layer's base plus its update; the cached path still equals the
    training path's forward."""
    from llmlab.models.lora import apply_lora
    from llmlab.models.quantize import quantize

    _, folder = folders["v3-yarn-qlora-moe"]
    model = from_pretrained(folder)
    if wrap == "int8":
        model = quantize(model, "int8")
        assert type(model.blocks[0].attn.kv_b_proj).__name__ == "QuantizedLinear"
    else:
        model = apply_lora(model, {"r": 4, "target_modules": "all-linear"})
        assert hasattr(model.blocks[0].attn.kv_b_proj, "lora_B")
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the update count
                torch.nn.init.normal_(p, std=0.1)
    model.eval()
    ids = _ids(6, batch=2, length=10)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        stepped = torch.cat(
            [model(ids[:, :6], attention=cache), model(ids[:, 6:], attention=cache)], 1
        )
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------- refusals
def _copy_with(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(num_key_value_heads=2), "latent attention gives every head its own key"),
        (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
        (dict(qk_head_dim=30), "qk_head_dim=30 disagrees"),
        (dict(kv_lora_rank_typo=3), "field 'kv_lora_rank_typo'"),
    ],
)
def test_unsupported_deepseek_fields_are_refused(change, reason, folders, tmp_path):
    _, folder = folders["v3-yarn-qlora-moe"]
    with pytest.raises(CheckpointError, match=reason):
        from_pretrained(_copy_with(folder, tmp_path / "changed", **change))


def test_deepseek_metadata_is_read_past(folders, tmp_path):
    """DeepSeek's own config.json fields that change nothing the causal LM computes."""
    _, folder = folders["v3-yarn-qlora-moe"]
    changed = _copy_with(
        folder, tmp_path / "meta", ep_size=8, aux_loss_alpha=0.001, seq_aux=True,
        scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
        num_nextn_predict_layers=1,
    )  # fmt: skip
    assert from_pretrained(changed).config == from_pretrained(folder).config


def test_multi_token_prediction_layers_are_read_past(folders, tmp_path):
    """DeepSeek-V3's files hold its MTP module as a layer past num_hidden_layers
    (model.layers.61.*); the causal LM does not run it, and transformers skips it too."""
    from safetensors.torch import load_file, save_file

    _, folder = folders["v3-yarn-qlora-moe"]
    shutil.copytree(folder, tmp_path / "mtp")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.randn(32, 64)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.randn(112, 16)
    save_file(state, str(tmp_path / "mtp" / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids(5)
    with torch.no_grad():
        torch.testing.assert_close(
            from_pretrained(tmp_path / "mtp").eval()(ids), from_pretrained(folder).eval()(ids)
        )


def test_bf16_export_keeps_the_selection_bias_in_fp32(folders, tmp_path):
    """As transformers keeps e_score_correction_bias in fp32 beside bf16 weights."""
    from safetensors import safe_open

    _, folder = folders["v3-yarn-qlora-moe"]
    model = from_pretrained(folder, dtype=torch.bfloat16)
    assert model.blocks[1].mlp.router.bias.dtype == torch.float32
    out = save_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert (
            f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
        )
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(router_scoring="softmax"), "routes by sigmoid scores"),
        (dict(moe_layers=[0]), "dense layers first"),
        (dict(shared_expert_intermediate_size=10), "ungated"),
        (dict(capacity_factor=1.0), "drops tokens"),
    ],
)
def test_export_refuses_a_latent_model_no_transformers_class_computes(change, reason, tmp_path):
    config = LlamaConfig(
        vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=4, intermediate_size=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, router_scoring="sigmoid",
        moe_layers=[1], shared_expert_intermediate_size=8,
    )  # fmt: skip
    import dataclasses

    with pytest.raises(ValueError, match=reason):
        save_pretrained(Llama(dataclasses.replace(config, **change)), tmp_path / "out")


def test_latent_fields_without_latent_attention_are_refused():
    with pytest.raises(ValueError, match="changes nothing without kv_lora_rank"):
        Llama(LlamaConfig(v_head_dim=16))
    with pytest.raises(ValueError, match="does not combine with n_kv_head"):
        Llama(LlamaConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))


@pytest.mark.parametrize("name", ["v3-yarn-qlora-moe", "no-renorm-one-group-biases"])
def test_the_serving_engine_decodes_like_transformers_from_one_latent_copy(name, folders):
    """Three prompts batched through the paged engine: each request's greedy tokens are HF
    ``generate``'s on that prompt alone, and the pool keeps each layer's compressed latent
    (``kv_lora_rank + qk_rope_head_dim`` per token) once: its values are its keys."""
    hf, folder = folders[name]
    ids = _ids(5, batch=3, length=9)
    prompts = [ids[0, :9].tolist(), ids[1, :5].tolist(), ids[2, :7].tolist()]
    engine = engine_matches_hf_greedy(from_pretrained(folder).eval(), hf, prompts, 10)
    pool = engine.runner.pool
    assert all(v is k for k, v in zip(pool.keys, pool.values, strict=True))
    assert pool.keys[0].shape == (64, 4, 1, 16 + 8)
    assert pool.nbytes == 3 * 64 * 4 * 24 * 4  # layers × blocks × block × (r + d_r) × fp32
