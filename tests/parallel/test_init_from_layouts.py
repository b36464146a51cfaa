"""``model.init_from=<folder>`` in N-D layouts: each rank reads only what it keeps, and the
first step's loss is that of the same weights on one process.

The folder is a random-initialised ``transformers`` ``LlamaForCausalLM`` written with
``save_pretrained`` (``tests/helpers/hf_tiny.py``). Eight gloo ranks run two fits in turn with the
real ``CausalLMTask`` and ``NDParallelStrategy``: data 2 × pipeline 2 × tensor 2, and data 4 ×
tensor 2 with ZeRO-3. Oracles, nobody's code here:

* loss: ``transformers``' own model of the folder on the same first global batch, cross-entropy
  by ``torch.nn.functional`` -- within 1e-5 (fp32);
* bytes: the safetensors headers of the folder (read with ``safetensors`` itself) give each
  tensor's full shape and size; a rank must have read exactly the bytes of the pieces it holds
  (``Σ local numel × 4``), its pieces must be ``1/tensor`` of the full tensor or the whole one, and
  its read must be within 1 % of ``1/tensor`` of its stage's share (the 1 %: the replicated
  RMSNorm weights, which every tensor rank reads whole);
* no rank reads a tensor of another pipeline stage (the names held by the two stages are
  disjoint and together cover the folder).
"""

from __future__ import annotations

import pytest
import torch

from llmlab.models.hf import PretrainedWeights
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_tiny import byte_level_llama_folder
from tests.helpers.tiny import pad_targets

LAYOUTS = {
    "2x2x2": dict(pipeline=2, tensor=2),
    "zero3-4x2": dict(tensor=2, zero=3),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return byte_level_llama_folder(tmp_path_factory.mktemp("init-layouts") / "tiny-llama")


def _fits(rank: int, world: int, folder: str) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy
    from tests.helpers.training import fit

    out = {}
    for name, layout in LAYOUTS.items():
        strategy = NDParallelStrategy(**layout, timeline_every_n_steps=0)
        result = fit(strategy, world, {"init_from": folder, "vocab_size": 256}, steps=1)
        model = result["trainer"].lightning_module.model
        held = {}
        for key, t in model.state_dict(keep_vars=True).items():
            if not t.is_meta:
                held[key] = tuple(t.shape)
        report = strategy.parallel.applied["init_from"]
        zero = strategy.zero_engine.memory_stats() if strategy.zero_engine else {}
        out[name] = {
            "loss": result["losses"][0],
            "coords": tuple(strategy.groups.coords),
            "held": held,
            "read": report.bytes_read,
            "share": report.share_bytes,
            "zero": zero,
        }
    return out


def _file_shapes(folder) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {n: tuple(f.get_slice(n).get_shape()) for n in names}


@pytest.mark.distributed
def test_every_rank_reads_only_its_slice_and_the_first_loss_matches(folder):
    hf, path = folder
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the first global batch of tests.helpers.training.make_data
        logits = hf(ids[:, :-1]).logits
    targets = pad_targets(ids[:, 1:], batch=8)  # the matrix's padded batches
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    results = run_distributed(_fits, 8, str(path), timeout=600)
    shapes = _file_shapes(path)
    sources = PretrainedWeights(path, config_of(path)).sources
    hf_name = {n: src.hf_name for n, src in sources.items()}
    for name, layout in LAYOUTS.items():
        tp = layout["tensor"]
        stages: dict[int, set[str]] = {}
        for rank, by_layout in enumerate(results):
            r = by_layout[name]
            torch.testing.assert_close(torch.tensor(r["loss"]), expected, atol=1e-5, rtol=0)
            pieces = 0
            for key, local in r["held"].items():
                full = shapes[hf_name[key]]
                assert local == full or (
                    [a * tp if a != b else a for a, b in zip(local, full)] == list(full)
                ), (name, rank, key, local, full)
                pieces += 4 * torch.Size(local).numel()
            assert r["read"] == pieces, (name, rank)  # exactly the pieces it holds, nothing more
            assert abs(r["read"] / (r["share"] / tp) - 1) < 0.01, (name, rank, r)
            stages.setdefault(r["coords"][1], set()).update(r["held"])
        names = [n for s in stages.values() for n in s]
        assert len(names) == len(set(names)), "two stages read the same layer"
        assert {hf_name[n] for n in names} == set(shapes)
    # ZeRO-3 read its TP slice whole and keeps a quarter of it (data = 4; within 1 %: the
    # padding that makes every unit split evenly).
    for by_layout in results:
        r = by_layout["zero3-4x2"]
        assert abs(r["zero"]["memory/params_bytes"] / (r["read"] / 4) - 1) < 0.01, r


def config_of(path):
    from llmlab.models import from_pretrained

    return from_pretrained(path, device="meta").config


# --------------------------------------------------------------------------- experts
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
EXPERT_LAYOUTS = {
    "dp2-ep2": dict(data=2, expert=2),
    "dp2-tp2-ep2": dict(data=2, tensor=2, expert=2),
}


def _expert_fit(rank: int, world: int, folder: str, layout: str) -> dict:
    import lightning as L

    from llmlab.parallel.strategy import NDParallelStrategy
    from tests.helpers.training import fit

    loaded: dict = {}

    class Loaded(L.Callback):  # the expert stacks as read, before the step changes them
        def on_train_start(self, trainer, task) -> None:
            loaded.update({k: t.clone() for k, t in task.model.state_dict().items()
                           if ".experts." in k})  # fmt: skip

    strategy = NDParallelStrategy(**EXPERT_LAYOUTS[layout])
    model_spec = {"init_from": folder, "vocab_size": 256}
    result = fit(strategy, world, model_spec, steps=1, callbacks=[Loaded()])
    model = result["trainer"].lightning_module.model
    return {
        "loss": result["losses"][0],
        "held": {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()},
        "read": strategy.parallel.applied["init_from"].bytes_read,
        "experts": loaded,
        "index": strategy.dims.expert_coords(strategy.groups.rank)[1],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_an_expert_parallel_rank_reads_only_its_experts(layout, tmp_path):
    """A random ``MixtralForCausalLM`` (4 experts, top-2; transformers writes each expert's
    ``w1/w2/w3`` as its own tensors) loaded on data 2 × expert 2 (and × tensor 2): each rank
    holds and reads only its 2 experts' tensors (the bytes read are exactly the pieces it
    holds), its expert stacks equal experts ``[2·index, 2·index + 2)`` of the whole model that
    ``from_pretrained`` loads, and the first loss is transformers' own on the same batch."""
    from llmlab.models import from_pretrained

    hf, path = byte_level_llama_folder(tmp_path / "tiny-mixtral", family="Mixtral", **MIXTRAL)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf(ids[:, :-1]).logits
    targets = pad_targets(ids[:, 1:], batch=8)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    whole = from_pretrained(path).state_dict()
    devices = 4 if "tp2" in layout else 2
    for r in run_distributed(_expert_fit, devices, str(path), layout, timeout=600):
        torch.testing.assert_close(torch.tensor(r["loss"]), expected, atol=1e-5, rtol=0)
        assert r["experts"], r["held"]
        lo = 2 * r["index"]
        for key, value in r["experts"].items():
            torch.testing.assert_close(value, whole[key][lo : lo + 2], atol=0, rtol=0)
        pieces = sum(4 * torch.Size(s).numel() for s in r["held"].values())
        assert r["read"] == pieces, (r["read"], pieces)  # its experts, its tensor shards
