"""Tiny random models for the serving tests, each with a HF twin (the oracle of exactness).

GPT-2 pairs come from tests/decoding/tiny.py (llmlab's ``GPT.from_hf_gpt2`` of a random
``GPT2LMHeadModel``); the Llama pair is a grouped-query ``LlamaForCausalLM`` (4 query heads
over 2 KV heads) loaded with ``Llama.from_hf``. ``initializer_range`` is raised so that
next-token distributions are peaked (greedy ties are then vanishingly unlikely, and eos ids and
stop strings are actually hit).
"""

from __future__ import annotations

import functools

import torch
import transformers
from transformers.utils import logging

from llmlab.models import GPT, Llama
from tests.decoding.tiny import hf_model, llmlab_model

logging.set_verbosity_error()


def gpt_pair(name: str = "v300_e64_h4") -> tuple[transformers.PreTrainedModel, GPT]:
    return hf_model(name), llmlab_model(name)


@functools.cache
def hf_llama(hidden_size: int = 48, intermediate_size: int = 80) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=200, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@functools.cache
def llama() -> Llama:
    return Llama.from_hf(hf_llama()).eval()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def byte_gpt() -> GPT:
    """A random GPT over the 256 byte values, to decode with ``llmlab.tokenizer.ByteTokenizer``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=32, n_layer=2,
                                     n_head=2, initializer_range=0.3, bos_token_id=None,
                                     eos_token_id=None)  # fmt: skip
    return GPT.from_hf_gpt2(transformers.GPT2LMHeadModel(config).eval()).eval()
