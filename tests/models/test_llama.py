"""The Llama against its oracles: HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` logits (random-initialised from a config, nothing downloaded), causality,
the KV cache vs a full forward, left padding, the GQA cache's size, and the contracts.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.models import Llama, LlamaConfig, build_model

TINY = LlamaConfig(
    vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48
)


def hf_causal_lm(arch: str = "Llama", kv_heads: int = 2, tied: bool = False, **extra):
    """A random HF causal LM. Norm weights and biases are perturbed away from their 1/0
    initialisation, so a mix-up of norms, or a bias that is dropped, shows in the logits."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        **extra,
    )
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


CASES = {
    "llama-gqa-untied": dict(arch="Llama", kv_heads=2),
    "llama-mha-tied": dict(arch="Llama", kv_heads=4, tied=True),
    "llama-mqa-bias": dict(arch="Llama", kv_heads=1, attention_bias=True),
    "qwen2-gqa-qkv-bias": dict(arch="Qwen2", kv_heads=2),
    "mistral-gqa-tied": dict(arch="Mistral", kv_heads=2, tied=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_hf(case):
    hf = hf_causal_lm(**CASES[case])
    ours = Llama.from_hf(hf).eval()
    c = ours.config
    assert c.n_kv_head == CASES[case]["kv_heads"] and c.tie_embeddings == CASES[case].get("tied", 0)
    ids = torch.randint(0, 101, (3, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # DEVELOPERS: within 1e-5


def test_biases_are_read_per_projection():
    """HF Llama's attention_bias biases q, k, v and o; Qwen2 biases q, k, v only."""
    llama = Llama.from_hf(hf_causal_lm("Llama", attention_bias=True)).config
    qwen = Llama.from_hf(hf_causal_lm("Qwen2")).config
    assert (llama.attention_bias, llama.attention_out_bias) == (True, True)
    assert (qwen.attention_bias, qwen.attention_out_bias) == (True, False)


def test_sliding_window_is_applied_and_unknown_rope_scaling_is_refused():
    mistral = hf_causal_lm("Mistral", sliding_window=24)
    ours = Llama.from_hf(mistral)
    assert (ours.config.block_size, ours.config.sliding_window) == (64, 24)
    ids = torch.randint(0, 101, (2, 40))  # longer than the window: it binds
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), mistral(ids).logits, atol=1e-5, rtol=0)
    scaled = hf_causal_lm(
        "Llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    )
    with pytest.raises(ValueError, match="rope_type='dynamic' is not implemented"):
        Llama.from_hf(scaled)


def test_changing_a_future_token_never_changes_earlier_logits():
    torch.manual_seed(1)
    model = Llama(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        base = model(ids)
        for t in (0, 7, 19):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
            assert not torch.allclose(out[:, t], base[:, t])


def test_kv_cache_decoding_equals_full_forward():
    torch.manual_seed(2)
    model = Llama(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :5], attention=cache)]  # prefill
        steps += [model(ids[:, t : t + 1], attention=cache) for t in range(5, 9)]
        steps.append(model(ids[:, 9:], attention=cache))  # a multi-token chunk after a prefix
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_left_padded_rows_decode_like_unpadded_ones():
    """Positions follow the mask into RoPE: the padded row's first real token is position 0."""
    torch.manual_seed(3)
    model = Llama(TINY).eval()
    short = torch.randint(0, TINY.vocab_size, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(short)
        got = model(padded, attention_mask=mask)
        # and the cached continuation of both agrees too
        nxt = expected[:, -1:].argmax(-1)
        cache_a, cache_b = model.new_cache(1, 16), model.new_cache(1, 16)
        model(short, attention=cache_a)
        model(padded, attention=cache_b, attention_mask=mask)
        step_a = model(nxt, attention=cache_a)
        step_b = model(nxt, attention=cache_b, attention_mask=torch.cat([mask, mask[:, -1:]], 1))
    torch.testing.assert_close(got[:, 3:], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(step_b, step_a, atol=1e-5, rtol=0)
    # Unmasked, the padded row would see RoPE angles shifted by three: a real difference.
    with torch.no_grad():
        shifted = model(padded, attention_mask=torch.ones_like(mask))[:, 3:]
    assert not torch.allclose(shifted, expected, atol=1e-3)


def test_gqa_cache_holds_only_the_kv_heads():
    """Done-when 4: the cache of n_kv_head=2 of 8 heads takes 2/8 of the MHA cache's bytes."""
    common = dict(vocab_size=64, block_size=64, n_layer=2, n_head=8, n_embd=64)

    def cache_bytes(n_kv_head: int) -> int:
        cache = Llama(LlamaConfig(**common, n_kv_head=n_kv_head)).new_cache(3, 40)
        return cache.nbytes  # keys + values of every layer

    mha, gqa, mqa = cache_bytes(8), cache_bytes(2), cache_bytes(1)
    assert mha == 2 * 2 * 3 * 8 * 40 * 8 * 4  # layers, k+v, batch, heads, len, head dim, fp32
    assert gqa * 8 == mha * 2 and mqa * 8 == mha


def test_pipeline_layers_compose_to_forward():
    torch.manual_seed(4)
    model = Llama(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    x = ids
    with torch.no_grad():
        for layer in model.pipeline_layers():
            x = layer(x)
        expected = model(ids)
    torch.testing.assert_close(x, expected, atol=0, rtol=0)


def test_contracts_and_the_plan_match_the_modules():
    model = Llama(TINY)
    names = dict(model.named_modules())
    import fnmatch

    for pattern in model.tensor_parallel_plan():
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern
    assert model.tensor_parallel_divisors()["n_kv_head"] == 2
    assert model.repeated_blocks() == list(model.blocks)
    assert model.swap_attention(lambda fn: fn) == TINY.n_layer
    attn = model.blocks[0].attn
    assert (attn.local_heads, attn.local_kv_heads) == (4, 2)


def test_swapped_attention_sees_gqa_shapes():
    model = Llama(TINY).eval()
    seen = []

    def wrap(fn):
        def spy(q, k, v, causal=True, dropout_p=0.0):
            seen.append((q.shape[1], k.shape[1]))
            return fn(q, k, v, causal, dropout_p)

        return spy

    model.swap_attention(wrap)
    model(torch.randint(0, TINY.vocab_size, (1, 6)))
    assert seen == [(4, 2)] * TINY.n_layer


def test_flops_per_token_counts_every_query_head():
    model = Llama(TINY)
    c = TINY
    D = c.n_embd // c.n_head
    attn = c.n_embd * c.n_head * D * 2 + c.n_embd * c.n_kv_head * D * 2  # q, o + k, v
    mlp = 3 * c.n_embd * c.intermediate_size
    n = c.n_layer * (attn + mlp + 2 * c.n_embd) + c.n_embd + c.vocab_size * c.n_embd  # + head
    assert model.num_params() == n  # untied: the input table is not counted
    assert model.flops_per_token(16) == 6 * n + 12 * c.n_layer * c.n_embd * 16


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_kv_head", 3, r"n_head=4 is not divisible by n_kv_head=3.*valid n_kv_head: \[1, 2, 4\]"),
        ("n_head", 5, r"n_embd=32 is not divisible by n_head=5"),
        ("n_embd", 36, r"n_embd=36 / n_head=4 = 9, the head dim, must be even"),
        ("kernels", "cuda", r"kernels='cuda' is not one of \['torch', 'triton', 'cpu'\]"),
        ("rope_theta", 0.0, r"rope_theta must be > 0"),
    ],
)
def test_bad_config_names_the_numbers(field, value, message):
    fields = {**TINY.to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        Llama(LlamaConfig(**fields))


def test_sequence_longer_than_block_size_is_refused():
    model = Llama(TINY)
    with pytest.raises(ValueError, match="position 32 is beyond the model's block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache(1, 32)
    model(torch.zeros(1, 30, dtype=torch.long), attention=cache)
    with pytest.raises(ValueError, match="position 32 is beyond the model's block_size 32"):
        model(torch.zeros(1, 3, dtype=torch.long), attention=cache)


def test_registry_builds_either_model_from_its_dict():
    llama = build_model({"arch": "llama", **TINY.to_dict()})
    gpt = build_model({"vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 16})  # no arch
    assert type(llama).__name__ == "Llama" and type(gpt).__name__ == "GPT"
    with pytest.raises(ValueError, match=r"unknown model arch 'mamba'; valid: \['gpt', 'llama'\]"):
        build_model({"arch": "mamba"})
    with pytest.raises(ValueError, match=r"LlamaConfig \(arch 'llama'\) has no field bias"):
        build_model({"arch": "llama", "bias": True})
