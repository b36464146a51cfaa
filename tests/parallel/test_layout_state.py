"""``LayoutState`` on one process: what a sharded Trainer checkpoint holds, and what it refuses.

The multi-rank behaviour (each rank its shards, resharding into other layouts) is tested with the
real strategy in ``test_nd_sharded_checkpoint.py``; here the format itself: a model and its AdamW
state go through DCP and come back equal, and a checkpoint of another model is refused by name
before any tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmlab.parallel.checkpoint import LayoutState, consolidate, metadata, read_extra
from llmlab.parallel.checkpoint.files import read_object
from llmlab.parallel.mesh import Coords
from tests.helpers.tiny import lm_loss, tiny_gpt, token_batch


def _trained(steps: int = 2, seed: int = 0, **config):
    model = tiny_gpt(seed=seed, dropout=0.0, **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = token_batch(seed=step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model) -> LayoutState:
    return LayoutState(model, coords=Coords(0, 0, 0, 0), tensor_size=1)


def test_model_and_adamw_state_round_trip_and_training_continues(tmp_path: Path) -> None:
    model, opt = _trained()
    _state(model).save(tmp_path / "ckpt", [opt], extra={"global_step": 2})
    keys = set(metadata(tmp_path / "ckpt").state_dict_metadata)
    assert "optim.embed.wte.weight.exp_avg" in keys and "optim.embed.wte.weight.step" in keys
    assert read_extra(tmp_path / "ckpt") == {"global_step": 2}
    meta = json.loads(read_object(tmp_path / "ckpt", "meta"))
    assert meta["aliases"], "the tied lm_head is recorded as an alias, stored once"

    fresh, fresh_opt = _trained(steps=0, seed=1)
    _state(fresh).load(tmp_path / "ckpt", [fresh_opt])
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh_opt.state[q][key]), key
    # One more step from either gives the same weights.
    for m, o in ((model, opt), (fresh, fresh_opt)):
        x, y = token_batch(seed=9)
        lm_loss(m(x), y).backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # Consolidated, it is the model's own state dict (aliases included).
    plain = consolidate(tmp_path / "ckpt")
    before = _trained(steps=0)[0]
    before.load_state_dict(plain)  # strict: every key, the tied one too


@pytest.mark.parametrize(
    "other, words",
    [(dict(n_layer=1), "this model has not"), (dict(n_embd=48), "has shape")],
    ids=["fewer-layers", "other-width"],
)
def test_a_checkpoint_of_another_model_is_refused_by_name(
    tmp_path: Path, other: dict, words: str
) -> None:
    model, opt = _trained(steps=1)
    _state(model).save(tmp_path / "ckpt", [opt])
    target, target_opt = _trained(steps=0, **other)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(KeyError, match="does not fit this model") as err:
        _state(target).load(tmp_path / "ckpt", [target_opt])
    assert words in str(err.value)
    for k, v in target.state_dict().items():  # refused before anything was read
        assert torch.equal(v, before[k]), k
