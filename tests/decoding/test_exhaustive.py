"""Exhaustive search returns the true argmax continuation.

Oracles: (1) brute force — every continuation scored independently by a full forward of the
model (no cache, no search code); (2) HF beam search with ``num_beams >= V^(N-1)``, which keeps
every prefix alive and is therefore exact, with ``early_stopping="never"``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from llmlab.decoding import GenerationConfig, generate
from llmlab.models import GPT

V, N = 6, 3


def tiny_pair():
    torch.manual_seed(3)
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            initializer_range=0.5,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()
    return hf, GPT.from_hf_gpt2(hf).eval()


def brute_force(model, prompt, eos=None):
    best = {}
    for seq in itertools.product(range(V), repeat=N):
        if eos is not None and eos in seq:
            seq = seq[: seq.index(eos) + 1]
        if seq in best:
            continue
        full = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logp = torch.log_softmax(model(full)[0, len(prompt) - 1 : -1].double(), -1)
        best[seq] = float(logp.gather(1, torch.tensor(seq)[:, None]).sum())
    return sorted(best.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("eos", [None, 2])
def test_exhaustive_finds_the_brute_force_argmax(eos):
    _, model = tiny_pair()
    prompt = [1, 4, 0]
    ranked = brute_force(model, prompt, eos)
    cfg = GenerationConfig(
        strategy="exhaustive",
        max_new_tokens=N,
        eos_token_id=eos,
        length_penalty=0.0,
        num_return_sequences=3,
        pad_token_id=5,
    )
    out = generate(model, torch.tensor([prompt]), cfg)
    for row, (seq, _) in zip(out.tolist(), ranked[:3]):
        got = row[len(prompt) :]
        assert got[: len(seq)] == list(seq) and all(t == 5 for t in got[len(seq) :])


def test_exhaustive_equals_exact_hf_beam_search():
    hf, model = tiny_pair()
    ids = torch.tensor([[3, 1, 1], [1, 2, 5]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    kw = dict(
        max_new_tokens=N, eos_token_id=4, pad_token_id=3, length_penalty=1.0, num_return_sequences=2
    )
    ref = hf.generate(
        ids,
        attention_mask=mask,
        num_beams=V ** (N - 1),
        early_stopping="never",
        do_sample=False,
        **kw,
    )
    ours = generate(model, ids, GenerationConfig(strategy="exhaustive", **kw), attention_mask=mask)
    assert torch.equal(ours, ref), f"\nHF exact beam:\n{ref}\nexhaustive:\n{ours}"


def test_exhaustive_beats_or_ties_narrow_beams():
    _, model = tiny_pair()
    prompt = torch.tensor([[2, 2, 3]])
    best = brute_force(model, prompt[0].tolist())[0][1]
    for nb in (2, 3):
        out = generate(model, prompt, num_beams=nb, max_new_tokens=N, length_penalty=0.0)
        seq = out[0, 3:].tolist()
        full = torch.cat([prompt, out[:, 3:]], 1)
        with torch.no_grad():
            lp = torch.log_softmax(model(full)[0, 2:-1].double(), -1)
        score = float(lp.gather(1, torch.tensor(seq)[:, None]).sum())
        assert score <= best + 1e-9


def test_exhaustive_refuses_huge_searches_before_work():
    _, model = tiny_pair()
    with pytest.raises(ValueError, match=r"6\*\*12"):
        generate(model, torch.tensor([[1]]), strategy="exhaustive", max_new_tokens=12)
