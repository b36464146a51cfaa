"""Tiny random GPT-2s shared by the decoding tests: a HF model and the same weights in llmlab.

``initializer_range`` is raised above GPT-2's 0.02 so that next-token distributions are peaked
enough for eos ids to be hit and for beams to disagree (a near-uniform model makes every
strategy look alike). Everything is float32 with fixed seeds; nothing is downloaded.
"""

from __future__ import annotations

import functools

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from llmlab.models import GPT

logging.set_verbosity_error()

CONFIGS = {
    "v100_e32_h2": dict(vocab_size=100, n_embd=32, n_head=2, initializer_range=0.3),
    "v300_e64_h4": dict(vocab_size=300, n_embd=64, n_head=4, initializer_range=0.2),
    "v1000_e48_h3": dict(vocab_size=1000, n_embd=48, n_head=3, initializer_range=0.25),
}


@functools.cache
def hf_model(name: str = "v100_e32_h2", seed: int = 0, n_layer: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_positions=128, n_layer=n_layer, bos_token_id=None, eos_token_id=None, **CONFIGS[name]
    )
    return GPT2LMHeadModel(cfg).eval()


@functools.cache
def llmlab_model(name: str = "v100_e32_h2", seed: int = 0, n_layer: int = 2) -> GPT:
    return GPT.from_hf_gpt2(hf_model(name, seed, n_layer)).eval()


def prompts(
    vocab: int, batch: int, length: int, seed: int = 0, pad_id: int = 1, padded: bool = True
):
    """(ids, mask): random prompts; with ``padded`` rows get 0..length//2 left pads (row 1 none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for b in range(batch):
            n = 0 if b == 1 else (b * 2 + 1) % (length // 2 + 1)
            mask[b, :n] = 0
    return ids.masked_fill(mask == 0, pad_id), mask


def common_tokens(hf, ids, mask, k: int = 2) -> list[int]:
    """Ids that greedy decoding actually emits: good eos ids (so rows really stop early)."""
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1)
    gen = out[:, ids.shape[1] :].flatten().tolist()
    seen = [t for t in dict.fromkeys(gen[3:] + gen) if t > 1]
    return seen[:k]
