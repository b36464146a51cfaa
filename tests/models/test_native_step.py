"""``GPT.native_decode_step`` and ``Llama.native_decode_step`` (llmlab.models.native): one
token's forward as one C++ call over per-layer paged KV pools. Oracle: the model's own
``forward`` on the whole sequence so far (fp32: the usual 1e-5; the C++ norms and attention are
loops of their own, so not bit for bit), and its pool writes checked against the keys and
values the model computes."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from llmlab.models import GPT, GPTConfig, Llama, LlamaConfig
from llmlab.models import native as native_module

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None,
    reason="the native decode step is compiled here: needs a C++ compiler",
)


def model_of(**overrides) -> GPT:
    torch.manual_seed(0)
    sizes = dict(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**sizes, **overrides})).eval()


def pools(model, num_blocks: int, dtype=torch.float32) -> tuple[list, list]:
    """Per-layer paged pools of blocks of 4 slots, as the serving engine lays them out (GPT's
    KV heads are its heads, Llama's its ``n_kv_head``)."""
    attn = model.blocks[0].attn
    kv_heads = getattr(attn, "local_kv_heads", attn.local_heads)
    keys = [torch.zeros(num_blocks, 4, kv_heads, attn.head_dim, dtype=dtype) for _ in model.blocks]
    return keys, [torch.zeros_like(k) for k in keys]


def decode(model, ids: list[int], table: list[int], keys, values) -> list[torch.Tensor]:
    """Each token's logits through the native step, its keys in the blocks of ``table``."""
    step = model.native_decode_step(keys, values)
    assert step is not None
    with torch.inference_mode():
        return [step(t, p, table)[0, -1] for p, t in enumerate(ids)]


def decode_against_forward(model, seed: int) -> tuple[list[int], list, list]:
    """38 random tokens decoded through the native step over ``TABLE``'s blocks, each step's
    logits checked against the model's ``forward`` (1e-5); returns the ids and the pools."""
    ids = torch.randint(0, 97, (38,), generator=torch.Generator().manual_seed(seed)).tolist()
    keys, values = pools(model, 16)
    got = decode(model, ids, TABLE, keys, values)
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    for p, logits in enumerate(got):
        torch.testing.assert_close(logits, want[p], atol=1e-5, rtol=1e-5, msg=f"position {p}")
    assert [int(x.argmax()) for x in got] == want.argmax(-1).tolist()
    return ids, keys, values


# blocks scattered over the pool, out of order: the step reads through the table
TABLE = [7, 2, 11, 0, 5, 9, 1, 12, 3, 14]


# the last: a head dim of 12, no multiple of the attention's 8-wide dot products
@pytest.mark.parametrize(
    "overrides", [{}, {"bias": False, "tie_embeddings": False}, {"n_head": 3, "n_embd": 36}]
)
def test_each_step_equals_the_models_forward(overrides):
    model = model_of(**overrides)
    ids, keys, values = decode_against_forward(model, seed=1)
    # the pools hold the model's own keys and values, position p at slot p % 4 of block
    # TABLE[p // 4], and nothing in the blocks the table does not name
    with torch.inference_mode():
        block = model.blocks[0]
        heads, dim = model.config.n_head, model.config.head_dim
        qkv = block.attn.qkv(block.ln_1(model.embed(torch.tensor([ids]))))
        qkv = qkv.view(1, 38, heads, 3, dim)
    for p in range(38):
        where = (TABLE[p // 4], p % 4)
        torch.testing.assert_close(keys[0][where], qkv[0, p, :, 1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(values[0][where], qkv[0, p, :, 2], atol=1e-6, rtol=1e-6)
    assert not keys[0][[4, 6, 8, 10, 13, 15]].any() and not keys[0][14, 2:].any()


def test_bfloat16_takes_atens_kernels_and_agrees_within_bf16():
    model = model_of().to(torch.bfloat16)
    ids = [5, 17, 3, 88, 41, 9, 60, 2]
    got = decode(model, ids, [3, 1], *pools(model, 4, torch.bfloat16))
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    for p, logits in enumerate(got):
        torch.testing.assert_close(logits.float(), want[p].float(), atol=3e-2, rtol=3e-2)


def test_no_step_where_it_would_compute_something_else(monkeypatch):
    model = model_of()
    keys, values = pools(model, 4)
    assert model.native_decode_step(keys, values) is not None
    # pools of another head count, or not laid out in blocks
    assert model.native_decode_step([k.view(4, 4, 2, 16) for k in keys], values) is None
    assert model.native_decode_step([k.view(16, 4, 8) for k in keys], values) is None

    class Scaled(torch.nn.Linear):  # a layer with a forward of its own (an adapter, say)
        def forward(self, x):
            return 2.0 * super().forward(x)

    old = model.blocks[1].mlp.fc
    model.blocks[1].mlp.fc = Scaled(old.in_features, old.out_features)
    assert model.native_decode_step(keys, values) is None
    model.blocks[1].mlp.fc = old
    monkeypatch.setenv("LLMLAB_NATIVE", "0")
    assert model.native_decode_step(keys, values) is None


@pytest.mark.parametrize("build", [model_of, lambda **kw: llama_of(**kw)])
def test_no_step_for_triton_kernels(build):
    """``kernels="triton"`` computes its norms and activations in llmlab.kernels: the native
    step, whose loops are the torch ops', would be another function."""
    model = build(kernels="triton")
    assert model.native_decode_step(*pools(model, 4)) is None


def test_the_extension_is_built_once_per_torch_version():
    assert torch.__version__.split("+")[0].replace(".", "_") in native_module.extension_name()
    assert native_module.load_extension() is native_module.load_extension()


def test_a_bad_table_or_token_is_refused_before_anything_is_written():
    model = model_of()
    keys, values = pools(model, 4)
    step = model.native_decode_step(keys, values)
    with torch.inference_mode():
        for position, table in [(4, [0]), (0, [4]), (5, [1, -1]), (0, []), (-1, [0])]:
            with pytest.raises(RuntimeError, match="GPTDecodeStep"):
                step(1, position, table)
        for token, position in [(-1, 0), (97, 0), (1, 64)]:  # vocabulary 97, 64 positions
            with pytest.raises(RuntimeError, match="outside the 97-token vocabulary"):
                step(token, position, list(range(4)) * 5)
    assert not any(k.any() for k in keys) and not any(v.any() for v in values)


def test_without_a_compiler_it_warns_once_and_returns_none(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "c++" else real_which(tool))
    load = native_module.load_extension.__wrapped__  # past the cache: as a fresh process would
    with pytest.warns(RuntimeWarning, match="no c\\+\\+ on PATH"):
        assert load() is None


def test_threads_may_step_at_once():
    """The step releases the GIL: two threads on one step object (each its own blocks) must not
    share scratch memory. Each thread's logits equal a lone run's."""
    model = model_of()
    keys, values = pools(model, 16)
    step = model.native_decode_step(keys, values)
    tables = [[0, 1, 2, 3, 4, 5, 6, 7], [15, 14, 13, 12, 11, 10, 9, 8]]
    ids = [[(7 * i + 3 * t) % 97 for i in range(32)] for t in range(2)]
    with torch.inference_mode():
        want = [[step(i, p, table)[0, -1].clone() for p, i in enumerate(row)]
                for row, table in zip(ids, tables)]  # fmt: skip
    got: list[list] = [[], []]

    def run(t: int) -> None:
        with torch.inference_mode():
            for _ in range(20):
                got[t].append([step(i, p, tables[t])[0, -1] for p, i in enumerate(ids[t])])

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in range(2):
        for run_logits in got[t]:
            for a, b in zip(run_logits, want[t]):
                assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- Llama
LLAMA_VARIANTS = [
    {},  # grouped-query: 4 query heads over 2 KV heads
    {"attention_bias": True, "attention_out_bias": True, "tie_embeddings": True},  # Qwen2-like
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    {"n_kv_head": 1, "head_dim": 12},  # multi-query, a head dim no multiple of 8
]  # fmt: skip


def llama_of(**overrides) -> Llama:
    torch.manual_seed(0)
    sizes = dict(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                 intermediate_size=48)  # fmt: skip
    return Llama(LlamaConfig(**{**sizes, **overrides})).eval()


@pytest.mark.parametrize("overrides", LLAMA_VARIANTS)
def test_each_llama_step_equals_the_models_forward(overrides):
    model = llama_of(**overrides)
    ids, _, values = decode_against_forward(model, seed=2)
    # the pool holds the values the model computes (keys are rotated: checked via the logits)
    with torch.inference_mode():
        block = model.blocks[0]
        v = block.attn.v_proj(block.attn_norm(model.embed(torch.tensor([ids]))))[0]
    for p in range(38):
        torch.testing.assert_close(values[0][TABLE[p // 4], p % 4].flatten(), v[p], atol=1e-6,
                                   rtol=1e-6)  # fmt: skip


def test_no_llama_step_where_it_would_compute_something_else():
    keys, values = pools(llama_of(), 4)
    assert llama_of().native_decode_step(keys, values) is not None
    # q/k norms (Qwen3), a window shorter than the context, bf16, a KV-head count the pools lack
    assert llama_of(qk_norm=True).native_decode_step(keys, values) is None
    assert llama_of(sliding_window=8).native_decode_step(keys, values) is None
    assert llama_of().to(torch.bfloat16).native_decode_step(*pools(llama_of(), 4,
                                                            torch.bfloat16)) is None  # fmt: skip
    assert llama_of(n_kv_head=4).native_decode_step(keys, values) is None
    model = llama_of()
    model.blocks[0].mlp.up_proj = type("Adapter", (torch.nn.Linear,), {})(32, 48, bias=False)
    assert model.native_decode_step(keys, values) is None


def test_a_tied_llama_with_a_column_major_table_decodes_the_same():
    """The serving engine may store a tied embedding column-major (llmlab.decoding.layout: the
    LM head reads faster so on some CPUs); a token's row is then strided."""
    model = llama_of(tie_embeddings=True)
    weight = model.embed.tokens.weight
    assert model.head.lm_head.weight is weight
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()  # same values, column-major
    assert weight.stride(0) == 1
    ids = [5, 17, 3, 88, 41, 9, 60, 2, 33]
    got = decode(model, ids, [2, 0, 1], *pools(model, 4))
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    for p, logits in enumerate(got):
        torch.testing.assert_close(logits, want[p], atol=1e-5, rtol=1e-5)


def test_a_llama_position_past_its_angle_table_is_refused():
    model = llama_of()  # block_size 64: angles for positions 0..63
    keys, values = pools(model, 20)
    step = model.native_decode_step(keys, values)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="64 positions"):
        step(1, 64, list(range(20)))
    assert not any(k.any() for k in keys)
