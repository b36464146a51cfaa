"""``GPT.native_decode_step`` (llmlab.models.native): one token's forward as one C++ call over
per-layer KV pools. Oracle: the model's own ``forward`` on the whole sequence so far (fp32: the
usual 1e-5; the C++ layer norms and attention are loops of their own, so not bit for bit), and
its pool writes checked against the keys and values the model computes."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmlab.models import GPT, GPTConfig
from llmlab.models import native as native_module

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None,
    reason="the native decode step is compiled here: needs a C++ compiler",
)


def model_of(**overrides) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32, **overrides)
    return GPT(config).eval()


def pools(model: GPT, slots: int, dtype=torch.float32) -> tuple[list, list]:
    heads, dim = model.config.n_head, model.config.head_dim
    keys = [torch.zeros(slots // 4, 4, heads, dim, dtype=dtype) for _ in model.blocks]
    return keys, [torch.zeros_like(k) for k in keys]


def decode(model: GPT, ids: list[int], first: int, keys, values) -> list[torch.Tensor]:
    """Each token's logits through the native step, its keys from slot ``first`` on."""
    step = model.native_decode_step(keys, values)
    assert step is not None
    with torch.inference_mode():
        return [step(t, p, first + p, first, p + 1)[0, -1] for p, t in enumerate(ids)]


@pytest.mark.parametrize("overrides", [{}, {"bias": False, "tie_embeddings": False}])
def test_each_step_equals_the_models_forward(overrides):
    model = model_of(**overrides)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    keys, values = pools(model, 64)
    got = decode(model, ids, 8, keys, values)
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    for p, logits in enumerate(got):
        torch.testing.assert_close(logits, want[p], atol=1e-5, rtol=1e-5, msg=f"position {p}")
    assert [int(x.argmax()) for x in got] == want.argmax(-1).tolist()
    # the pools hold the model's own keys and values at slots 8 .. 47, nothing elsewhere
    with torch.inference_mode():
        x = model.embed(torch.tensor([ids]))
        block = model.blocks[0]
        qkv = block.attn.qkv(block.ln_1(x)).view(1, len(ids), 4, 3, 8)
    flat = keys[0].view(-1, 4, 8)
    torch.testing.assert_close(flat[8:48], qkv[0, :, :, 1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(values[0].view(-1, 4, 8)[8:48], qkv[0, :, :, 2], atol=1e-6,
                               rtol=1e-6)  # fmt: skip
    assert not flat[:8].any() and not flat[48:].any()


def test_bfloat16_takes_atens_kernels_and_agrees_within_bf16():
    model = model_of().to(torch.bfloat16)
    ids = [5, 17, 3, 88, 41, 9, 60, 2]
    got = decode(model, ids, 0, *pools(model, 16, torch.bfloat16))
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    for p, logits in enumerate(got):
        torch.testing.assert_close(logits.float(), want[p].float(), atol=3e-2, rtol=3e-2)


def test_no_step_where_it_would_compute_something_else(monkeypatch):
    model = model_of()
    keys, values = pools(model, 16)
    assert model.native_decode_step(keys, values) is not None
    # pools of another head count
    assert model.native_decode_step([k.view(4, 4, 2, 16) for k in keys], values) is None

    class Scaled(torch.nn.Linear):  # a layer with a forward of its own (an adapter, say)
        def forward(self, x):
            return 2.0 * super().forward(x)

    old = model.blocks[1].mlp.fc
    model.blocks[1].mlp.fc = Scaled(old.in_features, old.out_features)
    assert model.native_decode_step(keys, values) is None
    model.blocks[1].mlp.fc = old
    monkeypatch.setenv("LLMLAB_NATIVE", "0")
    assert model.native_decode_step(keys, values) is None


def test_the_extension_is_built_once_per_torch_version():
    assert torch.__version__.split("+")[0].replace(".", "_") in native_module.extension_name()
    assert native_module.load_extension() is native_module.load_extension()


def test_slots_outside_the_pool_are_refused_before_anything_is_written():
    model = model_of()
    keys, values = pools(model, 16)
    step = model.native_decode_step(keys, values)
    with torch.inference_mode():
        for slot, first, length in [(16, 0, 17), (5, 0, 5), (3, 4, 2), (0, -1, 2), (0, 0, 0)]:
            with pytest.raises(RuntimeError, match="must lie in the pool"):
                step(1, 0, slot, first, length)
    assert not any(k.any() for k in keys) and not any(v.any() for v in values)
