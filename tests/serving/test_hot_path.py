"""The engine's hot path (one decode over consecutive blocks, the model's ``inference_forward``)
computes exactly what the general path computes: the same logits bit for bit, not merely within
a tolerance, so greedy tokens cannot change with the path a step takes. The native step
(``EngineConfig.native_step``, GPT only) agrees with it to fp32 rounding, and the engine's
tokens with it equal HF's (tests/serving/test_engine_exactness.py runs with it on)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from llmlab.decoding import GenerationConfig
from llmlab.serving import LLMEngine
from llmlab.serving.config import EngineConfig
from llmlab.serving.model_runner import ModelRunner
from llmlab.serving.scheduler import Chunk
from llmlab.serving.sequence import Request
from tests.serving.models import gpt_pair, hf_llama, llama, random_prompts

CONFIG = EngineConfig(block_size=4, num_blocks=40, max_model_len=64)
PYTHON_STEP = EngineConfig(block_size=4, num_blocks=40, max_model_len=64, native_step=False)


def test_inference_forward_is_forward_bit_for_bit():
    model = gpt_pair()[1]
    ids = torch.tensor(random_prompts(300, [13], seed=3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]])  # two packed sequences
    with torch.inference_mode():
        for keep in (0, 1, torch.tensor([6, 12])):
            want = model(ids, positions=positions, logits_to_keep=keep)
            got = model.inference_forward(ids, positions=positions, logits_to_keep=keep)
            assert torch.equal(got, want), keep


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_one_decode_on_consecutive_blocks_equals_the_general_path_bit_for_bit(which, monkeypatch):
    from llmlab.serving import model_runner

    monkeypatch.setattr(model_runner, "EACH_MAX_SEQS", 0)  # `b` takes the general path
    model = gpt_pair()[1] if which == "gpt" else llama()
    runner = ModelRunner(model, PYTHON_STEP)
    prompt = random_prompts(200, [9], seed=4)[0]
    # the same tokens twice: `a` on consecutive blocks (hot path), `b` scattered (the layout)
    a, b = (Request(n, prompt, GenerationConfig(), i).new_sequence(0, prompt)
            for i, n in enumerate("ab"))  # fmt: skip
    a.block_table = [0, 1, 2, 3, 4]
    b.block_table = [20, 7, 13, 30, 9]
    la, lb = runner.execute([Chunk(a, 0, 9)]), runner.execute([Chunk(b, 0, 9)])
    assert torch.equal(la, lb)
    for _ in range(8):  # crosses two block boundaries (positions 12 and 16)
        token = int(la[-1].argmax())
        for seq in (a, b):
            seq.token_ids.append(token)
        steps = [Chunk(s, s.num_tokens - 1, 1) for s in (a, b)]
        assert runner.prepare(steps[:1]).single is not None
        assert runner.prepare(steps[1:]).single is None
        la, lb = runner.execute(steps[:1]), runner.execute(steps[1:])
        assert torch.equal(la, lb)
    # and both equal a plain forward of the whole sequence (the usual 1e-5)
    with torch.inference_mode():
        plain = model(torch.tensor([a.token_ids]))[0, -1]
    torch.testing.assert_close(la[0], plain, atol=1e-5, rtol=1e-5)


def test_a_hook_turns_the_lean_forward_off():
    model = gpt_pair()[1]
    runner = ModelRunner(model, CONFIG)
    assert runner._lean_forward() is not None
    calls = []
    handle = model.blocks[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    try:
        assert runner._lean_forward() is None
        seq = Request("x", [5, 6, 7], GenerationConfig(), 0).new_sequence(0, [5, 6, 7])
        seq.block_table = [0, 1]
        runner.execute([Chunk(seq, 0, 3)])
        assert calls == [1]  # the hook ran: the model's own forward was used
        seq.token_ids.append(8)  # and for a decode too, which the native step would take
        runner.execute([Chunk(seq, 3, 1)])
        assert calls == [1, 1]
        model.train()  # training mode: the model's own forward (dropout and all)
        seq.token_ids.append(9)
        runner.execute([Chunk(seq, 4, 1)])
        assert calls == [1, 1, 1]
    finally:
        model.eval()
        handle.remove()
    assert runner._lean_forward() is not None


def test_a_replaced_layer_turns_the_lean_forward_off():
    """A layer with a forward of its own (here a Linear subclass that scales its output, as an
    adapter would change it) must run: the engine's logits are the model's own, not the lean
    forward's, which would call F.linear on the weight and skip it."""

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    model = copy.deepcopy(gpt_pair()[1])  # the pair is cached: later tests compare it with HF
    old = model.blocks[0].mlp.fc
    new = Scaled(old.in_features, old.out_features, bias=old.bias is not None)
    new.load_state_dict(old.state_dict())
    model.blocks[0].mlp.fc = new
    assert not model.inference_forward_applies()
    runner = ModelRunner(model, CONFIG)
    assert runner._lean_forward() is None
    seq = Request("x", [5, 6, 7], GenerationConfig(), 0).new_sequence(0, [5, 6, 7])
    seq.block_table = [0]
    got = runner.execute([Chunk(seq, 0, 3)])
    ids, positions = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]])
    with torch.inference_mode():
        want = model(ids)[0, -1:]
        # what the lean path would give
        skipped = model.inference_forward(ids, positions)[0, -1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(skipped, want, atol=1e-3)  # so the comparison can fail


def test_a_few_decodes_one_sdpa_each_equal_the_general_path(monkeypatch):
    """Decode-only steps of up to EACH_MAX_SEQS sequences attend one sequence at a time (a pool
    view for consecutive blocks, a gather otherwise): the logits of the general path's layout,
    padding and masks (which the same step takes with the shortcut off) within fp32 rounding,
    and the same greedy tokens."""
    from llmlab.serving import model_runner

    model = gpt_pair()[1]
    runner = ModelRunner(model, CONFIG)
    prompts = random_prompts(300, [9, 5, 14], seed=5)
    seqs = [Request(str(i), p, GenerationConfig(), i).new_sequence(0, p)
            for i, p in enumerate(prompts)]  # fmt: skip
    seqs[0].block_table = [0, 1, 2, 3]  # consecutive: a view of the pool
    seqs[1].block_table = [21, 8]  # scattered: a gather
    seqs[2].block_table = [30, 11, 12, 5, 26]
    for seq in seqs:
        runner.execute([Chunk(seq, 0, seq.num_tokens)])
    for _ in range(3):  # decode steps, crossing a block boundary
        for seq in seqs:
            seq.token_ids.append(int(seq.token_ids[-1] * 7 % 300))
        step = [Chunk(s, s.num_tokens - 1, 1) for s in seqs]
        assert runner.prepare(step).each is not None
        each = runner.execute(step)
        with monkeypatch.context() as m:
            m.setattr(model_runner, "EACH_MAX_SEQS", 0)
            assert runner.prepare(step).each is None
            general = runner.execute(step)  # rewrites the same keys and values at the same slots
        # fp32 rounding only (2e-6 here): unmasked SDPA calls against the layout's masked ones
        torch.testing.assert_close(each, general, atol=1e-5, rtol=1e-5)
        assert torch.equal(each.argmax(-1), general.argmax(-1))


@pytest.mark.skipif(
    not shutil.which("c++"), reason="the native step is compiled here: needs a C++ compiler"
)
def test_the_native_step_agrees_with_the_python_step():
    """Runners on copies of one GPT, with and without the native step, decode one prompt
    greedily: on consecutive blocks (the Python hot path) and on scattered ones (the Python
    runner's one-SDPA-per-sequence path, ``_attend_each``; it equals the general path, tested
    above). The native step takes every decode of both, and its logits equal the Python step's
    to fp32 rounding at every step, with the same tokens."""
    model = gpt_pair()[1]
    native, python = ModelRunner(copy.deepcopy(model), CONFIG), ModelRunner(model, PYTHON_STEP)
    assert native.native.get() is not None and python.native.get() is None
    prompt = random_prompts(300, [7], seed=5)[0]
    calls = []
    step = native.native._step
    native.native._step = lambda *args: calls.append(args) or step(*args)
    for table in (list(range(10)), [31, 4, 17, 8, 22, 0, 39, 12, 5, 26]):
        seqs = [Request(n, prompt, GenerationConfig(), i).new_sequence(0, prompt)
                for i, n in enumerate("ab")]  # fmt: skip
        for seq in seqs:
            seq.block_table = list(table)
        runners = (native, python)
        logits = [r.execute([Chunk(s, 0, 7)]) for r, s in zip(runners, seqs)]
        for _ in range(25):  # to position 31: eight blocks of 4
            torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
            token = int(logits[1][-1].argmax())
            assert int(logits[0][-1].argmax()) == token
            for seq in seqs:
                seq.token_ids.append(token)
            logits = [r.execute([Chunk(s, s.num_tokens - 1, 1)]) for r, s in zip(runners, seqs)]
    assert len(calls) == 50  # every decode went through the native step, no prefill did


def test_the_native_step_is_rebuilt_for_a_copy():
    """An engine's model holds its runner; a deep copy of it gets a step over its own pool."""
    model = copy.deepcopy(gpt_pair()[1])
    runner = ModelRunner(model, CONFIG)
    clone = copy.deepcopy(runner)
    if runner.native.get() is None:
        pytest.skip("no native step here (no C++ compiler)")
    assert clone.native.get() is not None and clone.native.get() is not runner.native.get()
    seq = Request("x", [5, 6, 7], GenerationConfig(), 0).new_sequence(0, [5, 6, 7])
    seq.block_table = [0]
    clone.execute([Chunk(seq, 0, 3)])
    seq.token_ids.append(9)
    clone.execute([Chunk(seq, 3, 1)])
    assert clone.pool.keys[0].view(-1, *clone.pool.keys[0].shape[2:])[3].any()
    assert not runner.pool.keys[0].any()  # the original's pool is untouched


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_a_lone_request_through_the_native_step_equals_hf_generate(which):
    """Every decode of a lone request takes the native step (counted); its greedy tokens are
    HF ``generate``'s, token for token, on the same random weights."""
    hf, model = gpt_pair() if which == "gpt" else (hf_llama(), llama())
    engine = LLMEngine(copy.deepcopy(model), config=CONFIG)
    step = engine.runner.native.get()
    if step is None:
        pytest.skip("no native step here (no C++ compiler)")
    calls = []
    engine.runner.native._step = lambda *args: calls.append(args) or step(*args)
    prompt = random_prompts(200, [6], seed=7)[0]
    engine.add_request("lone", prompt, GenerationConfig(max_new_tokens=40))
    while engine.has_unfinished:
        outputs = engine.step()
    ids = torch.tensor([prompt])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=40, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert outputs[0].outputs[0].token_ids == want
    assert len(calls) == 39  # the first token comes from the prefill


def test_a_hook_or_training_mode_keeps_a_llamas_decodes_off_the_native_step():
    """Llama has no lean forward: the runner's own check (eval mode, no hook) gates its native
    step, and a hooked or training model decodes through its own forward."""
    model = copy.deepcopy(llama())
    runner = ModelRunner(model, CONFIG)
    step = runner.native.get()
    if step is None:
        pytest.skip("no native step here (no C++ compiler)")
    native_calls, hook_calls = [], []
    runner.native._step = lambda *args: native_calls.append(args) or step(*args)
    seq = Request("x", [5, 6, 7], GenerationConfig(), 0).new_sequence(0, [5, 6, 7])
    seq.block_table = [0, 1]
    runner.execute([Chunk(seq, 0, 3)])
    seq.token_ids.append(8)
    runner.execute([Chunk(seq, 3, 1)])
    assert len(native_calls) == 1
    handle = model.blocks[1].mlp.register_forward_hook(lambda *_: hook_calls.append(1))
    seq.token_ids.append(9)
    runner.execute([Chunk(seq, 4, 1)])
    handle.remove()
    model.train()
    seq.token_ids.append(10)
    runner.execute([Chunk(seq, 5, 1)])
    model.eval()
    assert len(native_calls) == 1 and hook_calls == [1]
