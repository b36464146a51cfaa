"""Many LoRA adapters over one base in one continuous batch (llmlab.serving.adapters).

Oracle: HF + peft. Each adapter is made by peft on the tiny random HF Llama
(tests/serving/models.py) with its own rank, targets and scaling (one rsLoRA), ``A`` and ``B``
random and non-zero, and saved as peft's folder; the engine serves all three plus the base over
one llmlab copy of that Llama. Every request of the mixed batch must decode exactly the greedy
tokens of ``generate`` on the peft model of its adapter alone (the base's: on the HF model).
Then: the prefix cache never hands one adapter's blocks to another, an unknown adapter is
refused naming the served ones, a quantized base serves adapters as ``generate`` on the same
quantized model with the adapter loaded, and the OpenAI client picks an adapter by ``model``.
"""

from __future__ import annotations

import copy

import openai
import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

from llmlab.decoding import GenerationConfig, generate  # noqa: E402
from llmlab.models import GPT, quantize  # noqa: E402
from llmlab.models.lora import LoRAConfig, load_lora  # noqa: E402
from llmlab.models.lora_serving import MultiLoRALinear  # noqa: E402
from llmlab.serving import LLM, EngineConfig, LLMEngine  # noqa: E402
from llmlab.serving.__main__ import parse_args  # noqa: E402
from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate  # noqa: E402
from llmlab.serving.sequence import RequestOptions  # noqa: E402
from llmlab.serving.server import ServerState  # noqa: E402
from llmlab.tokenizer import ByteTokenizer  # noqa: E402
from tests.helpers.hf_tiny import hf_greedy  # noqa: E402
from tests.serving.live import LiveServer  # noqa: E402
from tests.serving.models import hf_llama, llama, random_prompts  # noqa: E402

ADAPTERS = {  # different ranks, targets and scalings
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=2, lora_alpha=3, target_modules="all-linear", use_rslora=True),
}
NEW_TOKENS = 10
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """name -> (peft model with that adapter alone, its saved folder)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(copy.deepcopy(hf_llama()), peft.LoraConfig(**config))
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():  # A and B random, non-zero (peft starts B at zero)
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / name)
        out[name] = (model.eval(), root / name)
    return out


def _engine(peft_adapters, **config) -> LLMEngine:
    sizes = dict(block_size=8, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64)
    return LLMEngine(
        copy.deepcopy(llama()),  # the helper's model is shared: the engine wraps its layers
        config=EngineConfig(**{**sizes, **config}),
        adapters={name: folder for name, (_, folder) in peft_adapters.items()},
    )


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]], n: int) -> dict:
    config = GenerationConfig(max_new_tokens=n)
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, config, RequestOptions(adapter=adapter))
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_a_mixed_batch_decodes_each_request_as_peft_with_its_adapter_alone(peft_adapters):
    engine = _engine(peft_adapters)
    layers = {n for n, m in engine.model.named_modules() if isinstance(m, MultiLoRALinear)}
    assert len(layers) == 14 and max(m.max_rank for m in engine.model.modules()
                                     if isinstance(m, MultiLoRALinear)) == 8  # fmt: skip
    names = [None, "attn", "mlp", "all"]
    prompts = random_prompts(200, [5, 11, 3, 17, 8, 6, 13, 9], seed=1)
    requests = [(f"r{i}", p, names[i % 4]) for i, p in enumerate(prompts)]
    seen: list[set] = []  # the adapters of each step's forward
    step = engine.adapters.step
    engine.adapters.step = lambda chunks, device: (
        seen.append({c.seq.request.options.adapter for c in chunks}) or step(chunks, device)
    )
    done = _run(engine, requests, NEW_TOKENS)
    assert max(map(len, seen)) == 4  # base and three adapters in one forward
    differs = 0
    for rid, prompt, adapter in requests:
        hf = hf_llama() if adapter is None else peft_adapters[adapter][0]
        want = hf_greedy(hf, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        assert done[rid] == want, (rid, adapter)
        base = hf_greedy(hf_llama(), torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        differs += want != base
    assert differs >= 5  # the adapters do change the tokens (the test would see a dropped one)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_adapters_speculate_as_they_decode(peft_adapters, method):
    """Speculative decoding beside adapters: drafts from n-grams, or from the base model in int8
    (a draft that knows no adapter), are verified by the adapted target: each request still
    decodes peft's tokens."""
    draft = copy.deepcopy(llama()) if method == "draft" else None
    engine = LLMEngine(
        copy.deepcopy(llama()),
        config=EngineConfig(
            block_size=8, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64,
            speculative=method, draft_quantize="int8" if draft is not None else None,
        ),
        adapters={name: folder for name, (_, folder) in peft_adapters.items()},
        draft_model=draft,
    )  # fmt: skip
    names = [None, "attn", "mlp", "all"]
    prompts = random_prompts(200, [5, 11, 3, 17], seed=2)
    requests = [(f"r{i}", p * 2, names[i]) for i, p in enumerate(prompts)]  # repeats: n-grams
    done = _run(engine, requests, NEW_TOKENS)
    for rid, prompt, adapter in requests:
        hf = hf_llama() if adapter is None else peft_adapters[adapter][0]
        assert done[rid] == hf_greedy(hf, torch.tensor([prompt]), NEW_TOKENS)[0].tolist(), rid
    assert engine.speculator.proposed > 0
    assert method == "ngram" or engine.speculator.accepted > 0


def test_the_prefix_cache_never_shares_blocks_across_adapters(peft_adapters):
    """The same 24-token prompt under the base, "attn" and again "attn": the second "attn"
    request reuses the first's full blocks, the first "attn" request none of the base's."""
    engine = _engine(peft_adapters)
    prompt = random_prompts(200, [24], seed=5)[0]
    blocks = engine.scheduler.blocks
    _run(engine, [("base", prompt, None)], 4)
    assert blocks.stats().hits == 0
    done = _run(engine, [("attn1", prompt, "attn")], 4)
    assert blocks.stats().hits == 0  # same tokens, another adapter: nothing shared
    done |= _run(engine, [("attn2", prompt, "attn")], 4)
    assert blocks.stats().hits == 2  # (24 - 1) // 8 full blocks of the same adapter
    want = hf_greedy(peft_adapters["attn"][0], torch.tensor([prompt]), 4)[0].tolist()
    assert done["attn1"] == done["attn2"] == want


def test_an_unknown_adapter_is_refused_naming_the_served_ones(peft_adapters):
    engine = _engine(peft_adapters)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'.*\['all', 'attn', 'mlp'\]"):
        engine.add_request("x", [1, 2, 3], options=RequestOptions(adapter="nope"))
    assert not engine.has_unfinished
    plain = LLMEngine(copy.deepcopy(llama()), config=EngineConfig(block_size=8, num_blocks=32))
    with pytest.raises(ValueError, match="none is served"):
        plain.add_request("x", [1, 2, 3], options=RequestOptions(adapter="attn"))


def test_an_adapter_on_the_lm_head_is_refused_at_start():
    """Only the kept rows reach the head, not each token of the step: refused by name (here an
    adapter given as a ``(LoRAConfig, state)`` pair)."""
    state = {"head.lm_head.lora_A.weight": torch.ones(2, 48),
             "head.lm_head.lora_B.weight": torch.ones(200, 2)}  # fmt: skip
    model = copy.deepcopy(llama())
    with pytest.raises(ValueError, match=r"adapter 'head' targets the LM head \(head.lm_head\)"):
        LLMEngine(model, config=EngineConfig(block_size=8, num_blocks=32),
                  adapters={"head": (LoRAConfig(r=2), state)})  # fmt: skip


def test_a_quantized_base_serves_adapters_as_generate_on_it(peft_adapters):
    """int8 base: each adapter's tokens are ``generate``'s on the same int8 model with that
    adapter loaded (llmlab's LoRALinear over the quantized layers)."""
    engine = _engine(peft_adapters, quantize="int8")
    prompts = random_prompts(200, [7, 12, 5, 9], seed=2)
    names = [None, "attn", "mlp", "all"]
    done = _run(engine, [(f"r{i}", p, names[i]) for i, p in enumerate(prompts)], NEW_TOKENS)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        ref = quantize(copy.deepcopy(llama()), "int8")
        if name is not None:
            ref = load_lora(ref, peft_adapters[name][1])
        want = generate(ref.eval(), torch.tensor([prompt]), config)[0, len(prompt) :].tolist()
        assert done[f"r{i}"] == want, name


def _byte_gpt2_with_adapter(folder):
    """A random byte-level HF GPT-2 (vocab 256, so ByteTokenizer decodes its ids) and peft's
    adapter on its fused ``c_attn`` and ``c_fc`` (GPT-2's Conv1D: fan_in_fan_out), saved."""
    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=2, initializer_range=0.3, bos_token_id=None,
                                     eos_token_id=None)  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                           fan_in_fan_out=True)  # fmt: skip
    tuned = peft.get_peft_model(copy.deepcopy(hf), lora)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in tuned.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    tuned.save_pretrained(folder)
    return hf, tuned.eval()


def test_the_openai_client_picks_an_adapter_by_model_name(tmp_path):
    """A real server (uvicorn on 127.0.0.1) with ``--lora``'s adapters: ``/v1/models`` lists
    the base and the adapter, ``model`` picks the adapter (its text is peft's greedy text), an
    unknown model is a 404 naming what is served."""
    hf, tuned = _byte_gpt2_with_adapter(tmp_path / "bytes-lora")
    config = EngineConfig(block_size=8, num_blocks=32, max_num_seqs=8)
    model = GPT.from_hf_gpt2(copy.deepcopy(hf)).eval()
    engine = LLMEngine(model, TOK, config, adapters={"bytes-lora": tmp_path / "bytes-lora"})
    state = ServerState(engine, "tiny-bytes", ChatTemplate(PLAIN_TEMPLATE))
    prompt = "To be, or not"
    ids = torch.tensor([TOK.encode(prompt)])
    want = {
        "tiny-bytes": TOK.decode(hf_greedy(hf, ids, 8)[0].tolist()),
        "bytes-lora": TOK.decode(hf_greedy(tuned, ids, 8)[0].tolist()),
    }
    assert want["tiny-bytes"] != want["bytes-lora"]
    with LiveServer(state) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", max_retries=0, timeout=60)
        cards = client.models.list().data
        assert [m.id for m in cards] == ["tiny-bytes", "bytes-lora"]
        for name, text in want.items():
            out = client.completions.create(model=name, prompt=prompt, max_tokens=8,
                                            temperature=0)  # fmt: skip
            assert (out.model, out.choices[0].text) == (name, text)
        chat = client.chat.completions.create(
            model="bytes-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "bytes-lora" and chat.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError, match=r"'nope' does not exist.*bytes-lora"):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
        live.wait_idle()


def test_the_offline_llm_takes_an_adapter_per_call(peft_adapters):
    llm = LLM(copy.deepcopy(llama()), block_size=8, num_blocks=32,
              adapters={"mlp": peft_adapters["mlp"][1]})  # fmt: skip
    prompt = random_prompts(200, [6], seed=9)[0]
    got = llm.generate([prompt], GenerationConfig(max_new_tokens=5), progress=False, lora="mlp")
    want = hf_greedy(peft_adapters["mlp"][0], torch.tensor([prompt]), 5)[0].tolist()
    assert got[0].token_ids == [want]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        llm.generate([prompt], progress=False, lora="attn")


def test_the_cli_reads_lora_flags(tmp_path):
    (tmp_path / "a").mkdir()
    args = parse_args(["base", "--lora", f"a={tmp_path / 'a'}", "--lora", f"b={tmp_path}"])
    assert args.adapters == {"a": str(tmp_path / "a"), "b": str(tmp_path)}
    for bad in ("a", f"={tmp_path}", f"a={tmp_path / 'missing'}"):
        with pytest.raises(SystemExit):
            parse_args(["base", "--lora", bad])
