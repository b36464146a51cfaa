"""The engine's product function (``llmlab.serving.linear``): one row is ``F.linear`` bit for bit,
more rows go through oneDNN within fp32 rounding, and a weight changed after packing is packed
again rather than read stale."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from llmlab.serving.config import EngineConfig
from llmlab.serving.linear import Linears, onednn_available
from llmlab.serving.model_runner import ModelRunner
from tests.serving.models import gpt_pair

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")


@needs_onednn
def test_one_row_is_f_linear_and_more_rows_agree_within_rounding():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    linears = Linears(layer)
    assert linears.enabled
    with torch.inference_mode():
        one = torch.randn(1, 1, 48)
        assert torch.equal(linears(one, layer), F.linear(one, layer.weight, layer.bias))
        for rows in (2, 3, 17):
            x = torch.randn(1, rows, 48)
            torch.testing.assert_close(
                linears(x, layer), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5
            )


@needs_onednn
def test_a_weight_changed_after_packing_is_packed_again():
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 16)
    linears = Linears(layer)
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves
    got = linears(x, layer)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert (layer in linears._packed) == onednn_available()  # the copy packed its own weight
    with torch.no_grad():
        layer.weight.data = torch.randn(16, 32)  # replaced: new storage
    got = linears(x, layer)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert (layer in linears._packed) == onednn_available()  # the copy packed its own weight


def test_disabled_or_other_modules_use_f_linear():
    class Scaled(torch.nn.Linear):  # a subclass has its own forward: never packed
        pass

    layer, sub = torch.nn.Linear(8, 8), Scaled(8, 8)
    x = torch.randn(1, 5, 8)
    for linears, module in ((Linears(layer, enabled=False), layer), (Linears(sub), sub)):
        assert not linears.enabled
        assert torch.equal(linears(x, module), F.linear(x, module.weight, module.bias))


@needs_onednn
def test_the_runner_packs_on_cpu_unless_told_not_to():
    config = EngineConfig(block_size=4, num_blocks=40, max_model_len=64)
    assert ModelRunner(gpt_pair()[1], config).linear.enabled
    off = EngineConfig(block_size=4, num_blocks=40, max_model_len=64, onednn_linear=False)
    assert not ModelRunner(gpt_pair()[1], off).linear.enabled


def test_a_served_model_can_still_be_deep_copied():
    """The runner's attention lives in the model, so a copy of the model copies the runner;
    the copy's products pack the copied weights (oneDNN's packed tensors cannot be copied)."""
    model = copy.deepcopy(gpt_pair()[1])
    runner = ModelRunner(model, EngineConfig(block_size=8, num_blocks=8, max_model_len=64))
    twin = copy.deepcopy(model)
    linears = copy.deepcopy(runner.linear)
    assert linears.enabled == runner.linear.enabled
    layer = twin.blocks[0].mlp.fc
    x = torch.randn(3, layer.in_features)
    got = linears(x, layer)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert (layer in linears._packed) == onednn_available()  # the copy packed its own weight
