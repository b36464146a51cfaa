"""lm-eval's own ``local-completions`` model against the server scores as ``make eval`` does.

The checkpoint is a file in the form ``llmlab.train`` saves (``hyper_parameters`` with the
model's and the byte tokenizer's configs, ``model.``-prefixed weights), with random weights
drawn wide enough that greedy continuations differ from prompt to prompt (a model trained a
few steps writes the same byte forever, which would leave the generation check empty).
``make export``'s function writes its HF folder: the tokenizer lm-eval loads
(``tokenizer_backend=huggingface``, ``tokenized_requests=True``: lm-eval counts context tokens
itself and sends token ids). The server on 127.0.0.1 serves the checkpoint. lm-eval scores
llmlab's log-likelihood tasks (``shakespeare_bpb``: rolling log-likelihoods;
``shakespeare_cloze``: multiple choice) and a generation task (``shakespeare_next_line``,
written here: the cloze passages, greedy until a line or sentence ends) through the server --
``echo`` with ``logprobs`` for every log-likelihood, plain completions for the generations --
and in-process: ``llmlab.train.evaluation.run.evaluate`` (what ``make eval`` runs) on llmlab's
tasks, and lm-eval with ``LlmlabLM`` on all three, per document.

Agreement: bits per byte, accuracies and exact match within 1e-4 (measured: 3e-7, 0, 0);
perplexities, exponentials of a mean log-likelihood (~1e20 for these weights), within 1e-4
of their size; each document's log-likelihood within 1e-4 or 1e-6 of its size (a sum of a few
hundred log-probabilities of about -7, which ``LlmlabLM`` adds in float32: measured 2e-4 on
-1,918); generations exactly. The model's context (512) holds every request whole, so neither
side truncates.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from llmlab.serving import EngineConfig, LLMEngine
from llmlab.serving.loading import load
from llmlab.serving.server import ServerState
from tests.serving.live import LiveServer

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models retry with it

SPEC = dict(vocab_size=256, block_size=512, n_layer=2, n_head=2, n_embd=32)
LIMIT = 8  # documents per task
METADATA = {"max_chars": 300}  # shakespeare_bpb: the first 300 characters of each held-out work
NAME = "romeo"

NEXT_LINE_TASK = """\
# The cloze passages as a generation task: the next line, greedy, until it ends.
task: shakespeare_next_line
custom_dataset: !function next_line.docs
output_type: generate_until
validation_split: validation
doc_to_text: "{{context}}"
doc_to_target: "{{choices[label]}}"
generation_kwargs:
  until: ["\\n\\n", "."]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

NEXT_LINE_DOCS = """\
def docs(**metadata):
    from llmlab.train.evaluation.tasks.shakespeare import cloze

    return cloze(**metadata)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(checkpoint, its HF export folder, a folder holding the generation task)."""
    from llmlab.models import build_model
    from llmlab.train.export import export

    root = tmp_path_factory.mktemp("lm_eval")
    torch.manual_seed(0)
    model = build_model(SPEC)
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.normal_(0.0, 0.3)
    checkpoint = root / "last.ckpt"
    hyper = {"model": SPEC, "tokenizer": {"_target_": "llmlab.train.data.ByteTokenizer"}}
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"hyper_parameters": hyper, "state_dict": state}, checkpoint)
    folder = export(checkpoint, root / "hf")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "shakespeare_next_line.yaml").write_text(NEXT_LINE_TASK)
    (tasks / "next_line.py").write_text(textwrap.dedent(NEXT_LINE_DOCS))
    return checkpoint, folder, tasks


def task_manager(extra):
    from lm_eval.tasks import TaskManager

    from llmlab.train.evaluation.run import TASKS_DIR

    return TaskManager(include_path=[str(TASKS_DIR), str(extra)], include_defaults=False,
                       metadata=METADATA)  # fmt: skip


def close(a, b, rel: float = 1e-6) -> bool:
    """Equal strings and flags; numbers 1e-4 apart, or ``rel`` of their size (a document's
    log-likelihood sums a few hundred float32 terms of about -10: float32 itself rounds such
    a sum by ~1e-4)."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, bool) or a is None:
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-4) or (math.isinf(a) and a == b)


def close_metric(key: str, a, b) -> bool:
    # a perplexity is exp(-mean log-likelihood): ~1e20 for random weights, so compared relatively
    return close(a, b, 1e-4 if "perplexity" in key else 1e-6)


def metrics(results: dict, task: str) -> dict[str, float]:
    return {k: v for k, v in results["results"][task].items()
            if "stderr" not in k and isinstance(v, int | float)}  # fmt: skip


def by_doc(results: dict, task: str) -> dict[int, list]:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def test_local_completions_against_the_server_scores_as_make_eval(run):
    import lm_eval
    from transformers import AutoTokenizer

    from llmlab.train.evaluation.lm import LlmlabLM
    from llmlab.train.evaluation.run import evaluate
    from llmlab.train.sample import load_checkpoint

    checkpoint, folder, extra = run
    model, tok = load_checkpoint(str(checkpoint))
    in_process = LlmlabLM(model, tok, batch_size=16)
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    text = "Your breath with full consent benied his sails;\nThe seas and winds, é"
    assert hf_tok(text, add_special_tokens=False).input_ids == in_process.tok_encode(text)

    ours = ["shakespeare_bpb", "shakespeare_cloze"]
    tasks = [*ours, "shakespeare_next_line"]
    # make eval's own function, on llmlab's tasks
    expected = evaluate(model, tok, ours, LIMIT, 16, METADATA)
    # the same model wrapper on every task, per document
    alone = lm_eval.simple_evaluate(model=in_process, tasks=tasks, limit=LIMIT,
                                    task_manager=task_manager(extra), log_samples=True,
                                    bootstrap_iters=0)  # fmt: skip

    loaded = load(checkpoint)
    config = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config)
    state = ServerState(engine, NAME, None, loaded.eos_token_ids)
    with LiveServer(state) as live:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": NAME,
                "base_url": f"{live.url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(folder),
                "tokenized_requests": True,
                "max_length": SPEC["block_size"],  # lm-eval keeps one token for generation
                "custom_prefix_token_id": in_process.prefix_token_id,
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks=tasks,
            limit=LIMIT,
            task_manager=task_manager(extra),
            log_samples=True,
            bootstrap_iters=0,
        )
        live.wait_idle()
        assert engine.scheduler.blocks.stats().used == 0
    assert engine.stats.errors_by_kind == {}

    for task in ours:  # make eval's numbers
        want, got = metrics(expected, task), metrics(served, task)
        assert want.keys() == got.keys() and want, task
        for key in want:
            assert close_metric(key, got[key], want[key]), (task, key, got[key], want[key])
    for task in tasks:  # and every document's log-likelihoods and generations
        want, got = metrics(alone, task), metrics(served, task)
        assert all(close_metric(k, got[k], want[k]) for k in want), (task, got, want)
        docs_want, docs_got = by_doc(alone, task), by_doc(served, task)
        assert docs_want.keys() == docs_got.keys() and len(docs_want) >= 5, task
        for doc, resps in docs_want.items():
            assert close(docs_got[doc], resps), (task, doc, docs_got[doc], resps)
    generations = [r[0] for r in by_doc(served, "shakespeare_next_line").values()]
    assert any(generations), generations  # the model wrote something
    # the log-likelihood tasks went through echo + logprobs: nothing was generated for them
    bpb = metrics(served, "shakespeare_bpb")["bits_per_byte,none"]
    assert 0 < bpb < 16
