"""Speculative decoding in the engine (``llmlab.serving.speculation``): the same tokens, faster.

Oracles: the engine without speculation (itself equal to HF ``generate``, see
test_engine_exactness) for greedy decoding, token for token, under preemption, prefix caching,
chunked prefill, forks, penalties, eos and stop strings, with log-probabilities; and, for
sampling, the target's exact distribution computed from its own forward: a chi-squared test of
the joint distribution of two generated tokens, drawn through drafts that the target often
rejects (a different random model; the n-gram proposer), with processors that depend on the
drafts in the context (repetition penalty, top-k). The test is shown to have power: the same
counts are rejected against the distribution without the penalty.
"""

from __future__ import annotations

import collections
import copy
import itertools

import httpx
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import chisquare

from llmlab.decoding import GenerationConfig, build_processors, generate
from llmlab.models import GPT
from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.sequence import RequestOptions
from llmlab.serving.speculation import ngram_drafts
from llmlab.tokenizer import ByteTokenizer
from tests.serving.engine_steps import drive, workload
from tests.serving.live import MODEL_NAME, LiveServer, byte_state
from tests.serving.models import byte_gpt, gpt_pair, hf_llama, llama

# the workload's pool: 14 blocks of 8 for 6 sequences, so it preempts (drafts book slots too)
SMALL = dict(
    block_size=8, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=112
)


def other_model(model: GPT, seed: int, noise: float = 0.5) -> GPT:
    """``model`` with noise on every weight (``noise`` times its spread): a draft the target
    often rejects."""
    draft = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * p.std().clamp(min=0.02))
    return draft


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_greedy_tokens_are_identical_with_every_proposer(family):
    model = gpt_pair()[1] if family == "gpt" else llama()
    vocab = model.config.vocab_size
    plain = drive(LLMEngine(copy.deepcopy(model), config=EngineConfig(**SMALL)), workload(vocab))
    engines = {
        "ngram": LLMEngine(copy.deepcopy(model), config=EngineConfig(speculative="ngram", **SMALL)),
        "int8 self-draft": LLMEngine(
            copy.deepcopy(model),
            config=EngineConfig(speculative="draft", draft_quantize="int8", **SMALL),
            draft_model=copy.deepcopy(model),
        ),
        "other draft": LLMEngine(
            copy.deepcopy(model),
            config=EngineConfig(speculative="draft", num_speculative_tokens=3, **SMALL),
            draft_model=other_model(model, seed=1),
        ),
    }
    for name, engine in engines.items():
        assert drive(engine, workload(vocab)) == plain, name
        spec = engine.speculator
        assert spec.proposed > 0 and spec.accepted <= spec.proposed, name
        # drafts were kept (the random Llama's text rarely repeats: n-grams seldom match it)
        assert spec.accepted > 0 or (name, family) == ("ngram", "llama"), name
        assert engine.scheduler.num_preemptions > 0, name  # drafts' slots were preempted too
        assert engine.scheduler.blocks.num_free == engine.config.num_blocks, name
        engine.scheduler.blocks.check([])
    # a self-draft agrees with its target almost always; a random one much less often
    assert engines["int8 self-draft"].speculator.acceptance_rate > 0.8
    assert engines["other draft"].speculator.acceptance_rate < 0.8


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_tokens_are_identical_over_a_quantized_target(scheme):
    """A quantized target (width 128: its products take the VNNI path where the CPU has it,
    which rounds each row of ``x`` to 16 bits per block, the same bits for a row whatever its
    batch): speculation and batching give the same greedy tokens as plain one-at-a-time
    decoding."""
    from llmlab.models import Llama, quantize

    model = Llama.from_hf(hf_llama(hidden_size=128, intermediate_size=256)).eval()
    options = EngineConfig(quantize=scheme, **SMALL)
    plain = drive(LLMEngine(copy.deepcopy(model), config=options), workload(200))
    for name, extra, draft in [
        ("ngram", dict(speculative="ngram"), None),
        ("other draft", dict(speculative="draft", num_speculative_tokens=3), other_model(model, 1)),
    ]:
        engine = LLMEngine(copy.deepcopy(model), config=EngineConfig(quantize=scheme, **extra,
                           **SMALL), draft_model=draft)  # fmt: skip
        assert drive(engine, workload(200)) == plain, name
        assert engine.speculator.proposed > 0, name
    quantized = quantize(copy.deepcopy(model), scheme)
    ids = torch.randint(0, 200, (4, 12), generator=torch.Generator().manual_seed(3))
    alone = [generate(quantized, ids[i : i + 1], max_new_tokens=40)[0].tolist() for i in range(4)]
    assert generate(quantized, ids, max_new_tokens=40).tolist() == alone


def test_rules_stops_and_logprobs_are_those_of_plain_decoding():
    """Penalties see the drafts in their context; eos, stop strings and max tokens cut a
    verified run where plain decoding stops; each kept token has its log-probability."""
    tok = ByteTokenizer()
    model = byte_gpt()
    prompt = list(b"To be, or not to be, that is the question")
    config = EngineConfig(block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=40)[0, len(prompt) :].tolist()
    requests = {
        "plain": GenerationConfig(max_new_tokens=40),
        "eos": GenerationConfig(max_new_tokens=40, eos_token_id=[tokens[9]]),
        "stop": GenerationConfig(max_new_tokens=40, stop_strings=[tok.decode(tokens[12:14])]),
        "penalised": GenerationConfig(
            max_new_tokens=40, repetition_penalty=1.5, no_repeat_ngram_size=3
        ),
        "short": GenerationConfig(max_new_tokens=3),
    }

    def serve(engine: LLMEngine) -> dict:
        for rid, gen in requests.items():
            engine.add_request(rid, prompt, gen, RequestOptions(logprobs=2))
        done, logprobs = {}, collections.defaultdict(list)
        while engine.has_unfinished:
            for out in engine.step():
                assert out.error is None
                logprobs[out.request_id] += out.outputs[0].new_logprobs
                if out.finished:
                    done[out.request_id] = (out.outputs[0], logprobs[out.request_id])
        return done

    plain = serve(LLMEngine(copy.deepcopy(model), tok, config))
    for method, draft in (("ngram", None), ("draft", other_model(model, seed=3))):
        spec_config = EngineConfig(**{**config.__dict__, "speculative": method})
        engine = LLMEngine(copy.deepcopy(model), tok, spec_config, draft_model=draft)
        got = serve(engine)
        assert engine.speculator.accepted > 0
        for rid in requests:
            (a, a_logprobs), (b, b_logprobs) = got[rid], plain[rid]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert len(a_logprobs) == len(a.token_ids)
            for x, y in zip(a_logprobs, b_logprobs):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert plain["eos"][0].finish_reason == plain["stop"][0].finish_reason == "stop"
    assert len(plain["short"][0].token_ids) == 3


def tiny_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=8, n_positions=32, n_embd=32, n_layer=2, n_head=2, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return GPT.from_hf_gpt2(transformers.GPT2LMHeadModel(config).eval()).eval()


PROMPT = [1, 2, 3, 1, 2]
SAMPLED = GenerationConfig(
    max_new_tokens=4, do_sample=True, temperature=0.9, top_k=6, repetition_penalty=1.3
)


@torch.no_grad()
def exact_pair_distribution(model: GPT, gen: GenerationConfig) -> torch.Tensor:
    """P(second token, third token) of ``gen`` after PROMPT, summed over the first token."""
    processors = build_processors(gen, len(PROMPT), None, sampling=True)

    def next_dist(context: list[int]) -> torch.Tensor:
        ids = torch.tensor([context])
        return torch.softmax(processors(ids, model(ids)[:, -1].float()), dim=-1)[0]

    vocab = model.config.vocab_size
    joint = torch.zeros(vocab, vocab)
    first = next_dist(PROMPT)
    for a in range(vocab):
        if first[a] > 0:
            second = next_dist([*PROMPT, a])
            for b in range(vocab):
                if second[b] > 0:
                    joint[b] += first[a] * second[b] * next_dist([*PROMPT, a, b])
    return joint


def chi2_pvalue(counts: collections.Counter, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` of (token, token) pairs to ``probs``; cells expecting
    fewer than 5 are pooled."""
    n = sum(counts.values())
    observed, expected, pooled = [], [], [0, 0.0]
    pairs = itertools.product(range(probs.shape[0]), repeat=2)
    for (b, c), p in zip(pairs, probs.flatten().tolist()):
        if p * n < 5:
            pooled[0] += counts[(b, c)]
            pooled[1] += p * n
        else:
            observed.append(counts[(b, c)])
            expected.append(p * n)
    observed.append(pooled[0])
    expected.append(pooled[1])
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def sample_pairs(engine: LLMEngine, n: int) -> collections.Counter:
    for i in range(n):
        engine.add_request(str(i), PROMPT, SAMPLED.replace(seed=i))
    counts: collections.Counter = collections.Counter()
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
                counts[(tokens[1], tokens[2])] += 1
    return counts


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(method):
    target = tiny_gpt(0)
    config = EngineConfig(
        block_size=4, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=32,
        speculative=method, num_speculative_tokens=2,
    )  # fmt: skip
    draft = tiny_gpt(1) if method == "draft" else None
    engine = LLMEngine(copy.deepcopy(target), config=config, draft_model=draft)
    counts = sample_pairs(engine, 4000)
    spec = engine.speculator
    # drafts were verified, and rejected often: the residual distribution was drawn from
    assert spec.proposed > 4000 and 0.05 < spec.acceptance_rate < 0.6
    assert chi2_pvalue(counts, exact_pair_distribution(target, SAMPLED)) > 1e-3
    # power: the same counts against the distribution without the repetition penalty
    unpenalised = SAMPLED.replace(repetition_penalty=1.0)
    assert chi2_pvalue(counts, exact_pair_distribution(target, unpenalised)) < 1e-6


def test_seeded_sampling_is_reproducible():
    model = gpt_pair()[1]
    config = EngineConfig(speculative="ngram", **SMALL)
    gen = GenerationConfig(max_new_tokens=30, do_sample=True, seed=5, num_return_sequences=2)
    outs = []
    for _ in range(2):
        engine = LLMEngine(copy.deepcopy(model), config=config)
        engine.add_request("a", list(range(3, 20)) * 2, gen)
        outs.append(drive(engine, {}))
    assert outs[0] == outs[1] and outs[0]["a"][0] != outs[0]["a"][1]


def test_ngram_lookup():
    assert ngram_drafts([5, 6, 7, 8, 5, 6], 3, 1, 3) == [7, 8, 5]  # the longest suffix that recurs
    assert ngram_drafts([1, 2, 9, 1, 2, 3, 1, 2], 2, 1, 2) == [3, 1]  # its latest occurrence
    assert ngram_drafts([1, 2, 3, 4], 3, 1, 2) == []  # nothing recurs
    assert ngram_drafts([4, 4], 3, 1, 2) == [4]  # what follows is all there is


def test_acceptance_is_in_metrics():
    model = gpt_pair()[1]
    engine = LLMEngine(copy.deepcopy(model), config=EngineConfig(speculative="ngram", **SMALL))
    engine.add_request("a", [3, 4, 5, 6] * 4, GenerationConfig(max_new_tokens=20))
    drive(engine, {})
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(engine.stats.prometheus())
        for s in family.samples
    }
    spec = engine.speculator
    assert samples["llmlab_spec_decode_num_draft_tokens_total"] == spec.proposed > 0
    assert samples["llmlab_spec_decode_num_accepted_tokens_total"] == spec.accepted
    assert samples["llmlab_spec_decode_acceptance_rate"] == pytest.approx(spec.acceptance_rate)


def test_bad_speculative_settings_are_refused_up_front():
    model = gpt_pair()[1]
    with pytest.raises(ValueError, match=r"speculative='medusa'; valid: None or one of"):
        LLMEngine(model, config=EngineConfig(speculative="medusa"))
    with pytest.raises(ValueError, match=r"draft model is given exactly when speculative='draft'"):
        LLMEngine(model, config=EngineConfig(speculative="draft"))
    with pytest.raises(ValueError, match=r"draft model is given exactly when"):
        LLMEngine(model, config=EngineConfig(), draft_model=model)
    with pytest.raises(ValueError, match=r"draft_quantize='int8' needs speculative='draft'"):
        LLMEngine(model, config=EngineConfig(speculative="ngram", draft_quantize="int8"))
    with pytest.raises(ValueError, match=r"draft model: vocab_size=8 differs from the target's"):
        LLMEngine(model, config=EngineConfig(speculative="draft"), draft_model=tiny_gpt(0))
    with pytest.raises(ValueError, match=r"draft model: it is the target model itself"):
        LLMEngine(model, config=EngineConfig(speculative="draft"), draft_model=model)
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be a positive integer"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0).validate()
    with pytest.raises(ValueError, match=r"ngram_min=3 must be <= ngram_max=2"):
        EngineConfig(speculative="ngram", ngram_min=3, ngram_max=2).validate()


def test_a_speculating_server_answers_as_a_plain_one():
    """The ``openai`` client against live servers on 127.0.0.1, with and without n-gram drafts:
    the same greedy text, streamed or not, and the acceptance counters in ``/metrics``."""
    prompt = "to be or not to be, to be or not to be, to be or not"
    answers = {}
    for method in (None, "ngram"):
        with LiveServer(byte_state(speculative=method)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
            plain = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0
            )
            stream = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True
            )
            streamed = "".join(chunk.choices[0].text for chunk in stream)
            metrics = httpx.get(f"{server.url}/metrics").text
            server.wait_idle()
            engine = server.state.engine
            assert engine.scheduler.blocks.num_free == engine.config.num_blocks
            assert method is None or engine.speculator.accepted > 0
        answers[method] = plain.choices[0].text
        assert streamed == answers[method]
    assert answers["ngram"] == answers[None]
    assert "llmlab_spec_decode_num_accepted_tokens_total" in metrics


@pytest.mark.parametrize(
    "options", [{"quantize": "int8"}, {"kv_cache_dtype": "bfloat16"}], ids=["int8", "bf16 kv"]
)
def test_speculation_beside_fewer_bytes_decodes_as_the_same_engine_without_it(options):
    """A quantized target, or a bf16 KV pool (the draft's pool too): drafts change nothing but
    the number of forwards."""
    model = gpt_pair()[1]
    vocab = model.config.vocab_size
    plain = LLMEngine(copy.deepcopy(model), config=EngineConfig(**SMALL, **options))
    spec = LLMEngine(
        copy.deepcopy(model),
        config=EngineConfig(**SMALL, **options, speculative="draft", draft_quantize="int8"),
        draft_model=copy.deepcopy(model),
    )
    assert drive(spec, workload(vocab)) == drive(plain, workload(vocab))
    assert spec.speculator.accepted > 0
