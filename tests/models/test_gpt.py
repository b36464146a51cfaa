"""The GPT against its oracles: HF GPT-2 logits, causality, and the KV cache vs a full forward."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def hf_gpt2(vocab: int = 101, layers: int = 2, heads: int = 4, width: int = 64, tied=True):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=48,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shape", [(2, 4, 64), (3, 2, 48)])
def test_logits_equal_hf_gpt2(tied, shape):
    layers, heads, width = shape
    hf = hf_gpt2(layers=layers, heads=heads, width=width, tied=tied)
    ours = GPT.from_hf_gpt2(hf).eval()
    ids = torch.randint(0, 101, (3, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # DEVELOPERS: within 1e-5


def test_changing_a_future_token_never_changes_earlier_logits():
    torch.manual_seed(1)
    model = GPT(TINY).eval()
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
    model = GPT(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :5], attention=cache)]  # prefill
        steps += [model(ids[:, t : t + 1], attention=cache) for t in range(5, 9)]
        steps.append(model(ids[:, 9:], attention=cache))  # a multi-token chunk after a prefix
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_left_padded_rows_decode_like_unpadded_ones():
    torch.manual_seed(3)
    model = GPT(TINY).eval()
    short = torch.randint(0, TINY.vocab_size, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(short)[:, -1]
        got = model(padded, attention_mask=mask)[:, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_pipeline_layers_compose_to_forward():
    torch.manual_seed(4)
    model = GPT(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    x = ids
    for layer in model.pipeline_layers():
        x = layer(x)
    torch.testing.assert_close(x, model(ids), atol=0, rtol=0)
    assert len(model.pipeline_layers()) == TINY.n_layer + 2


def test_bad_head_count_names_the_numbers():
    with pytest.raises(ValueError, match=r"n_embd=128 is not divisible by n_head=5"):
        GPT(GPTConfig(n_embd=128, n_head=5))


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_flops_per_token_matches_the_palm_formula():
    model = GPT(TINY)
    n = sum(p.numel() for p in model.parameters()) - TINY.block_size * TINY.n_embd
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 32 * 16
