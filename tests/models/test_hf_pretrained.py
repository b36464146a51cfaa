"""HF-format folders in and out, against ``transformers`` itself.

Each tiny random model of ``tests/helpers/hf_tiny.py`` (Llama 2 / 3.x, Mistral's window, Qwen2's
biases and per-layer window, Qwen3's q/k norms and explicit head_dim, GPT-2; tied and untied;
sharded and single-file) is saved by ``transformers`` and loaded by ``from_pretrained`` with no
``transformers`` model involved; then written back by ``save_pretrained`` and loaded by
``AutoModelForCausalLM``. Tolerances: logits within 1e-5 (DEVELOPERS.md), greedy tokens
identical, the llmlab round trip bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.decoding import generate
from llmlab.models import GPT, Llama, LlamaConfig, from_pretrained, save_pretrained
from tests.helpers.hf_tiny import VARIANTS, hf_greedy, save_variant

ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_variant(name, root) for name in VARIANTS}


def _ids(seed: int = 0, batch: int = 3, length: int = 17) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_pretrained_equals_transformers_and_exports_back(name, folders, tmp_path):
    hf, folder = folders[name]
    ours = from_pretrained(folder).eval()
    assert isinstance(ours, GPT if name.startswith("gpt2") else Llama)
    ids = _ids()
    prompt = ids[:1, :6]
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=ATOL, rtol=0)
    hf_tokens = hf_greedy(hf, prompt, 10)  # 10 tokens: Mistral's window of 6 binds
    assert torch.equal(generate(ours, prompt, max_new_tokens=10)[:, 6:], hf_tokens)

    out = save_pretrained(ours, tmp_path / "export", max_shard_size=25_000)
    again = from_pretrained(out)
    assert again.config == ours.config
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k  # bit-exact
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(hf_greedy(back, prompt, 10), hf_tokens)


def test_the_export_is_sharded_above_the_limit_only(folders, tmp_path):
    ours = from_pretrained(folders["llama2-mha-untied"][1])
    single = save_pretrained(ours, tmp_path / "one")
    sharded = save_pretrained(ours, tmp_path / "many", max_shard_size=10_000)
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    for shard in shards:  # each at most the limit, unless one tensor alone is larger
        assert (sharded / shard).stat().st_size <= 10_000 + 4096 or shard.endswith("1.safetensors")
    # re-exporting into the same folder as one file removes the old shards
    save_pretrained(ours, tmp_path / "many")
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(
        ["config.json", "model.safetensors"]
    )


def test_llmlab_models_export_with_their_own_switches(tmp_path):
    """Models built in llmlab (not loaded) pick the transformers class that computes them."""
    cases = {
        "llama": dict(),
        "qwen2": dict(attention_bias=True, sliding_window=4, window_layers=[1]),
        "qwen3": dict(qk_norm=True, head_dim=8, tie_embeddings=True),
        "mistral": dict(sliding_window=5),
    }
    ids = _ids(1, 2, 12)
    for family, switches in cases.items():
        torch.manual_seed(0)
        model = Llama(
            LlamaConfig(
                vocab_size=96,
                block_size=32,
                n_layer=2,
                n_head=4,
                n_kv_head=2,
                n_embd=32,
                intermediate_size=40,
                **switches,
            )
        ).eval()
        out = save_pretrained(model, tmp_path / family)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert hf.config.model_type == family
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, model(ids), atol=ATOL, rtol=0)


def test_dtype_and_block_size_are_use_settings(folders):
    gpt = from_pretrained(folders["gpt2-tied"][1], block_size=16, dtype=torch.bfloat16)
    assert gpt.config.block_size == 16 and gpt.embed.wpe.weight.shape[0] == 16
    assert gpt.embed.wte.weight.dtype == torch.bfloat16
    assert gpt.head.lm_head.weight is gpt.embed.wte.weight  # still tied
    with pytest.raises(ValueError, match="block_size=65 exceeds the 64 positions"):
        from_pretrained(folders["gpt2-tied"][1], block_size=65)
    meta = from_pretrained(folders["qwen3-qknorm-headdim"][1], device="meta")
    assert meta.blocks[0].attn.q_proj.weight.is_meta
