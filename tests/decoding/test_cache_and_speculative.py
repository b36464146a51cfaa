"""KV-cached vs uncached decoding, and speculative decoding against plain decoding.

Oracles: the uncached path recomputes the full sequence with the plain causal forward; plain
greedy is the oracle for speculative greedy; for speculative sampling the exact target
distribution (products of the target's next-token probabilities, computed by full forwards)
is the oracle of a chi-square test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from llmlab.decoding import GenerationConfig, HFModel, generate, speculative_generate
from llmlab.models import GPT, GPTConfig
from tests.decoding.tiny import common_tokens, hf_model, llmlab_model, prompts


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(num_beams=3, num_return_sequences=2),
        dict(do_sample=True, seed=5, top_k=20, num_return_sequences=2),
        dict(repetition_penalty=1.4, no_repeat_ngram_size=2),
    ],
)
@pytest.mark.parametrize("adapter", ["llmlab", "hf"])
def test_cached_equals_uncached(fields, adapter):
    ids, mask = prompts(100, 3, 6, seed=11)
    eos = common_tokens(hf_model(), ids, mask)
    model = llmlab_model() if adapter == "llmlab" else HFModel(hf_model())
    cfg = GenerationConfig(max_new_tokens=10, eos_token_id=eos, pad_token_id=1, **fields)
    cached = generate(model, ids, cfg, attention_mask=mask)
    uncached = generate(model, ids, cfg.replace(use_cache=False), attention_mask=mask)
    assert torch.equal(cached, uncached)


def test_padded_rows_decode_like_unpadded_rows():
    """Left padding + mask: each row's tokens equal decoding that row alone (greedy)."""
    ids, mask = prompts(300, 4, 7, seed=2)
    model = llmlab_model("v300_e64_h4")
    cfg = GenerationConfig(max_new_tokens=8, pad_token_id=1)
    batched = generate(model, ids, cfg, attention_mask=mask)
    for b in range(4):
        alone = generate(model, ids[b : b + 1, mask[b].bool()], cfg)
        assert batched[b, ids.shape[1] :].tolist() == alone[0, int(mask[b].sum()) :].tolist()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_greedy_equals_greedy(k):
    target = llmlab_model("v300_e64_h4", seed=0)
    draft = llmlab_model("v300_e64_h4", seed=1, n_layer=1)
    ids, mask = prompts(300, 3, 6, seed=4)
    eos = common_tokens(hf_model("v300_e64_h4"), ids, mask)
    for fields in (dict(), dict(eos_token_id=eos, repetition_penalty=1.3, min_new_tokens=2)):
        cfg = GenerationConfig(max_new_tokens=14, pad_token_id=1, num_assistant_tokens=k, **fields)
        plain = generate(target, ids, cfg, attention_mask=mask)
        spec = generate(target, ids, cfg, attention_mask=mask, draft_model=draft)
        assert torch.equal(spec, plain)
    # with the target as its own draft every proposal is accepted
    _, stats = speculative_generate(target, target, ids[1:2], cfg)
    assert stats.acceptance_rate == 1.0
    _, stats = speculative_generate(target, draft, ids[1:2], cfg)
    assert 0.0 <= stats.acceptance_rate < 1.0 and stats.proposed > 0


def _tiny_gpt(seed: int, n_layer: int, vocab: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=n_layer, n_head=2, n_embd=16))
    with torch.no_grad():  # sharper than the default init, so p and q really differ
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
    return model.eval()


@pytest.mark.parametrize(
    "V,N,n,k",
    [
        (4, 2, 600, 1),
        pytest.param(5, 3, 4000, 2, marks=pytest.mark.slow),
    ],
)
def test_speculative_sampling_preserves_the_target_distribution(V, N, n, k):
    """Chi-square: N-token continuations sampled speculatively follow p_target exactly."""
    target, draft = _tiny_gpt(0, 2, V), _tiny_gpt(1, 1, V)
    prompt = torch.tensor([[1, 3]])
    # exact probability of every continuation, from full forwards of the target
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N)))
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(target(full)[:, 1:-1].double(), dim=-1)
    token_logp = logp.gather(2, seqs[:, :, None]).squeeze(-1).sum(1)
    expected_p = token_logp.exp()
    assert abs(float(expected_p.sum()) - 1.0) < 1e-9

    cfg = GenerationConfig(do_sample=True, max_new_tokens=N, num_assistant_tokens=k, seed=123)
    out, stats = speculative_generate(
        target,
        draft,
        prompt.expand(n, -1).contiguous(),
        cfg,
        generator=torch.Generator().manual_seed(123),
    )
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    codes = (out[:, 2:] * (V ** torch.arange(N - 1, -1, -1))).sum(1)
    observed = torch.bincount(codes, minlength=V**N).double()
    expected = expected_p * n
    # merge rare cells so every expected count is >= 5 (chi-square validity)
    order = expected.argsort()
    obs_m, exp_m, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_o += float(observed[i])
        acc_e += float(expected[i])
        if acc_e >= 5:
            obs_m.append(acc_o)
            exp_m.append(acc_e)
            acc_o = acc_e = 0.0
    obs_m[-1] += acc_o
    exp_m[-1] += acc_e
    _, p_value = chisquare(obs_m, exp_m)
    assert p_value > 1e-3, f"p={p_value:.2e}: speculative samples do not follow the target"
    # and a wrong distribution (the draft's) is rejected by the same test: the test has power
    with torch.no_grad():
        q_logp = torch.log_softmax(draft(full)[:, 1:-1].double(), dim=-1)
    q = q_logp.gather(2, seqs[:, :, None]).squeeze(-1).sum(1).exp() * n
    _, p_wrong = chisquare(observed.numpy(), (q * observed.sum() / q.sum()).numpy())
    assert p_wrong < 1e-6


def test_speculative_greedy_with_hf_models_uses_cache_crop():
    """Target and draft as ``HFModel``: rejected drafts are cropped from HF's DynamicCache."""
    target = HFModel(hf_model("v300_e64_h4"))
    draft = HFModel(hf_model("v300_e64_h4", seed=1, n_layer=1))
    ids, mask = prompts(300, 2, 6, seed=4)
    cfg = GenerationConfig(max_new_tokens=12, pad_token_id=1, num_assistant_tokens=3)
    plain = generate(target, ids, cfg, attention_mask=mask)
    assert torch.equal(generate(target, ids, cfg, attention_mask=mask, draft_model=draft), plain)
