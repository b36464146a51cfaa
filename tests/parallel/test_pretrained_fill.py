"""``load_pretrained`` on one process: a meta model filled from an HF folder equals
``from_pretrained``'s bit for bit, the Parameter objects (and what hangs on them) survive, and a
piece of the wrong shape is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmlab.models import from_pretrained
from llmlab.models.hf import build_model_unloaded
from llmlab.parallel.checkpoint.pretrained import fill, load_pretrained
from tests.helpers.hf_tiny import save_variant


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_variant("llama3.2-rope-tied-headdim", tmp_path_factory.mktemp("fill"))[1]


def test_a_meta_model_filled_whole_equals_from_pretrained(folder):
    model, weights = build_model_unloaded({"init_from": str(folder)})
    tied = model.head.lm_head.weight
    assert tied.is_meta and tied is model.embed.tokens.weight
    report = load_pretrained(model, weights)
    assert model.head.lm_head.weight is tied and not tied.is_meta  # same object, still tied
    expected = from_pretrained(folder).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert report.bytes_read == report.share_bytes == weights.total_bytes()  # each tensor once


def test_fill_keeps_the_object_its_attributes_and_its_gradient_hooks():
    with torch.device("meta"):
        layer = nn.Linear(4, 3, bias=False)
    p = layer.weight
    p.tp_shard_dim = 0
    p.register_hook(lambda g: 2 * g)  # as sequence parallelism's gradient all-reduce
    fill(p, torch.ones(3, 4))
    assert layer.weight is p and p.tp_shard_dim == 0 and isinstance(p, nn.Parameter)
    layer(torch.ones(2, 4)).sum().backward()
    assert torch.equal(p.grad, torch.full((3, 4), 4.0))  # 2 rows, doubled by the hook


def test_a_piece_of_the_wrong_shape_is_refused_by_name(folder):
    model, weights = build_model_unloaded({"init_from": str(folder)})
    model.embed.tokens.weight.tp_shard_dim = 0  # marked as a shard, but holds the full table
    with pytest.raises(ValueError, match=r"embed\.tokens\.weight: the checkpoint gives shape"):
        load_pretrained(model, weights, tensor_rank=0, tensor_size=2)
