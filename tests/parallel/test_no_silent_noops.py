"""No silent no-ops (issue 15): an option meant to transform modules says how many it changed
(``log.info``) and is an error when that number is 0.

The four options: fp8 (the precision plugin's ``convert_module``), activation checkpointing and
recompute attention (``parallelize_model``'s memory step), ``kernels="triton"``
(``llmlab.models.build_model``). Oracle for the counts: the GPT's own structure (2 blocks: 2
attention modules, 2 checkpointed blocks, 4 fp8-eligible Linear layers per block at width 128).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from llmlab.models import GPT, GPTConfig, build_model
from llmlab.models.registry import ARCHITECTURES, register
from llmlab.parallel.parallelize import parallelize_model
from llmlab.parallel.precision import FP8Precision
from llmlab.parallel.transforms import ModelTransforms

SMALL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def test_memory_options_log_their_counts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llmlab.parallel.parallelize"):
        result = parallelize_model(
            _gpt(), transforms=ModelTransforms(activation_checkpointing=1, recompute_attention=8)
        )
    assert result.applied["recompute_attention"] == 2
    assert result.applied["activation_checkpointing"] == [0, 1]
    assert "recompute attention (block 8): 2 attention modules swapped" in caplog.text
    assert "activation checkpointing: 2 blocks wrapped" in caplog.text


def test_activation_checkpointing_that_wraps_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"every=3 wrapped no block of GPT"):
        parallelize_model(_gpt(), transforms=ModelTransforms(activation_checkpointing=3))


class _NoAttention(nn.Module):
    """Meets the memory contracts but has nothing to swap or wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def repeated_blocks(self) -> list[nn.Module]:
        return []

    def swap_attention(self, wrap) -> int:
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_memory_options_that_change_nothing_are_errors() -> None:
    with pytest.raises(ValueError, match=r"recompute attention: _NoAttention.swap_attention "
                       r"changed no module"):  # fmt: skip
        parallelize_model(_NoAttention(), transforms=ModelTransforms(recompute_attention=8))
    with pytest.raises(ValueError, match=r"repeated_blocks\(\) is empty: nothing to checkpoint"):
        parallelize_model(_NoAttention(), transforms=ModelTransforms(activation_checkpointing=1))


def test_fp8_logs_its_count_and_refuses_zero(caplog: pytest.LogCaptureFixture) -> None:
    plugin = FP8Precision(min_features=128, backend="emulate")
    with caplog.at_level(logging.INFO, logger="llmlab.parallel.precision.plugins"):
        plugin.convert_module(_gpt(n_embd=128))
    assert "fp8: converted 8 Linear layers" in caplog.text
    with pytest.raises(ValueError, match=r"precision=fp8 converted no layer of GPT.*"
                       r"min_features=128"):  # fmt: skip
        FP8Precision(min_features=128).convert_module(_gpt())


def test_triton_kernels_log_their_count(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llmlab.models.registry"):
        build_model({**SMALL, "kernels": "triton"})
    # per block: ln_1, attn, ln_2, mlp; plus ln_f in the head
    assert "kernels=triton: 9 modules use the triton ops" in caplog.text


@dataclasses.dataclass
class _PlainConfig:
    n_embd: int = 8
    kernels: str = "torch"

    def validate(self) -> None:
        pass


class _Plain(nn.Module):
    """A registered model that accepts ``kernels`` but never reads it."""

    def __init__(self, config: _PlainConfig) -> None:
        super().__init__()
        self.lin = nn.Linear(config.n_embd, config.n_embd)


def test_triton_kernels_that_no_module_uses_are_an_error() -> None:
    register("plain_for_test", _Plain, _PlainConfig)
    try:
        build_model({"arch": "plain_for_test"})  # torch: nothing asked, nothing to check
        with pytest.raises(ValueError, match=r"kernels='triton': no module of _Plain uses"):
            build_model({"arch": "plain_for_test", "kernels": "triton"})
    finally:
        ARCHITECTURES.pop("plain_for_test")
