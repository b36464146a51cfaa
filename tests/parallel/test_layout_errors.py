"""A layout error reads the same wherever it is found first: from the CLI
(``python -m llmlab.train``), from ``NDParallelStrategy(...)`` in user code, and from
``parallelize_model``. All three reach ``llmlab.parallel.mesh.check_layout``, the one function
that raises a layout error.

Three errors, one of each kind: the world size (data × tensor ≠ ranks), the heads (tensor ∤
n_head) and the batch split (data ∤ global batch). The CLI is given all three in one run (one
line, the problems joined in check_layout's order); user code and ``parallelize_model`` meet
them one at a time, on two gloo ranks, and each message must be exactly check_layout's phrase.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import run_train
from tests.helpers.tiny import TINY_GPT

HEADS = dict(TINY_GPT, n_head=3, n_embd=48)  # tensor=2 does not divide 3 heads
BATCH = 5  # data=2 does not divide it
PREFIX = "this layout cannot run: "


def _refusal(fn) -> str:
    from llmlab.parallel.mesh import LayoutError

    with pytest.raises(LayoutError) as err:
        fn()
    message = str(err.value)
    assert message.startswith(PREFIX), message
    return message[len(PREFIX) :]


def _user_code_and_parallelize_model(rank: int, world: int) -> dict[str, dict[str, str]]:
    import lightning as L

    from llmlab.models import GPT, GPTConfig
    from llmlab.parallel import ParallelDims, build_process_groups
    from llmlab.parallel.parallelize import parallelize_model
    from llmlab.parallel.strategy import NDParallelStrategy
    from tests.helpers.tiny import rank_trainer, tiny_task, tiny_tokens

    def fit(strategy, model: dict, batch: int) -> None:
        os.environ["WORLD_SIZE"] = str(world)  # Lightning's teardown removes it
        data = tiny_tokens(2, batch=batch, vocab_size=model["vocab_size"])
        rank_trainer(strategy, world, 1).fit(tiny_task(model), datamodule=data)

    user = {
        "world": _refusal(lambda: L.Trainer(
            accelerator="cpu", devices=world, strategy=NDParallelStrategy(data=2, tensor=2),
            logger=False, enable_checkpointing=False,
        )),  # refused by the Trainer's constructor: no process was launched for it
        "heads": _refusal(lambda: fit(NDParallelStrategy(tensor=2), HEADS, 8)),
        "batch": _refusal(lambda: fit(NDParallelStrategy(data=2), TINY_GPT, BATCH)),
    }  # fmt: skip
    groups = build_process_groups(ParallelDims(data=None))
    parallelize = {
        "world": _refusal(lambda: parallelize_model(
            GPT(GPTConfig(**TINY_GPT)), ParallelDims(data=2, tensor=2), groups
        )),
        "heads": _refusal(lambda: parallelize_model(
            GPT(GPTConfig(**HEADS)), ParallelDims(data=1, tensor=2), groups
        )),
        "batch": _refusal(lambda: parallelize_model(
            GPT(GPTConfig(**TINY_GPT)), ParallelDims(data=2), groups, global_batch=BATCH
        )),
    }  # fmt: skip
    return {"user": user, "parallelize": parallelize}


@pytest.mark.distributed
def test_a_layout_error_reads_the_same_from_the_cli_the_strategy_and_parallelize_model(tmp_path):
    args = [
        "experiment=gpt_tp2",
        "+strategy.data=2",  # data (2) × tensor (2) = 4 ranks, but trainer.devices is 2
        *(f"model.{k}={v}" for k, v in HEADS.items() if k != "vocab_size"),
        f"data.batch_size={BATCH}",
    ]
    cli = run_train(args, tmp_path)
    assert cli.returncode == 2, cli.stderr[-3000:]
    (line,) = [row for row in cli.stderr.splitlines() if row.startswith("error:")]
    assert "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert not (tmp_path / "gpt_tp2").exists()  # refused before any run dir or W&B run exists

    ranks = run_distributed(_user_code_and_parallelize_model, 2)
    for got in ranks:
        assert got["user"] == got["parallelize"] == ranks[0]["user"], got
    each = ranks[0]["user"]
    assert each["world"].startswith("data (2) × pipeline (1) × tensor (2) = 4, but the world")
    assert each["heads"] == "model.n_head=3 is not divisible by tensor=2"
    assert each["batch"].startswith(f"global batch {BATCH} is not divisible by data (2);")
    # the CLI found all three in one check: the same phrases, in check_layout's order
    assert line == "error: " + PREFIX + "; ".join([each["world"], each["heads"], each["batch"]])
