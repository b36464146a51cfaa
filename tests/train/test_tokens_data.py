"""``data=tokens`` at the data level: the global batches of any data-parallel degree are one
process's, batch by batch; a position saved at one degree resumes at another with the
uninterrupted sequence; document ids follow the documents; mixtures meet their weights.

Oracles: the single-process loader for the parallel ones (same module, one replica); for the
document ids, the end-of-document tokens inside each window (a byte corpus has id 256 only
there); for mixtures, the window contents (each source uses its own letters).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from llmlab.tokenizer import ByteTokenizer
from llmlab.train.mixture import MixtureSchedule, Shuffle
from llmlab.train.prepare import prepare
from llmlab.train.resumable import ResumableSampler
from llmlab.train.shards import DatasetError
from llmlab.train.tokens import TokenDataModule

T, B = 8, 8


def write_docs(path, letters: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        length = int(rng.integers(1, 40))
        lines.append("".join(rng.choice(list(letters), size=length)))
    path.write_text("".join(f'{{"text": "{t}"}}\n' for t in lines))


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    """Two prepared byte datasets: ``lower`` (letters abc) and ``upper`` (XYZ, a quarter of
    the size), under one folder, for single-source and mixture runs."""
    root = tmp_path_factory.mktemp("tokens")
    for name, letters, n in (("lower", "abc", 400), ("upper", "XYZ", 100)):
        write_docs(root / f"{name}.jsonl", letters, n, seed=len(name))
        prepare([str(root / f"{name}.jsonl")], root / "data" / name, shard_tokens=251,
                val_fraction=0.1, progress=False)  # fmt: skip
    return root / "data"


def module(datasets_dir, **kw) -> TokenDataModule:
    kw = {"block_size": T, "batch_size": B, "seed": 7, **kw}
    dm = TokenDataModule(str(datasets_dir / "lower"), **kw)
    dm.setup()
    return dm


def global_batches(dm, replicas: int, epochs: range, steps: int | None = None):
    """Global batches (rows, and document ids when on) rebuilt from every replica's loader:
    row ``j`` is row ``j // R`` of replica ``j % R`` (:mod:`llmlab.train.global_batch`)."""
    loaders = [dm.loader("train", replicas, r) for r in range(replicas)]
    out = []
    for epoch in epochs:
        for ld in loaders:
            ld.sampler.set_epoch(epoch)  # what Lightning's fit loop does each epoch
        for parts in zip(*loaders, strict=True):
            out.append(tuple(interleave([p[i] for p in parts]) for i in range(len(parts[0]))))
            if steps is not None and len(out) == steps:
                return out
    return out


def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    R = len(parts)
    return torch.stack([parts[j % R][j // R] for j in range(R * parts[0].shape[0])])


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        for t, u in zip(x, y, strict=True):
            assert torch.equal(t, u), f"global batch {k} differs"


def test_every_data_parallel_degree_sees_one_process_global_batches(datasets_dir):
    dm = module(datasets_dir, document_mask=True)
    one = global_batches(dm, 1, range(2))
    assert len(one) == 2 * (len(dm.split_dataset("train")) // B) > 20
    for replicas in (2, 4):
        assert_same(global_batches(dm, replicas, range(2)), one)
    # each epoch draws a new order from the seed, and the same seed draws the same one
    assert not torch.equal(one[0][0], one[len(one) // 2][0])
    fresh = global_batches(module(datasets_dir, document_mask=True), 1, range(1))
    assert_same(fresh, one[: len(one) // 2])


@pytest.mark.parametrize("stopped_at, resumed_on", [((0, 5), 1), ((1, 3), 4), ((0, 9), 2)])
def test_a_position_saved_at_two_replicas_resumes_at_another_degree(
    datasets_dir, stopped_at, resumed_on
):
    dm = module(datasets_dir)
    per_epoch = len(dm.split_dataset("train")) // B
    expected = global_batches(dm, 1, range(2))
    saved = dm.loader("train", 2, 0)
    saved.progress = lambda: stopped_at  # (epoch, batches done), as the trainer reports them
    state = saved.state_dict()
    loaders = [dm.loader("train", resumed_on, r) for r in range(resumed_on)]
    for ld in loaders:
        ld.load_state_dict(state)
        ld.sampler.set_epoch(stopped_at[0])
    rest = [tuple(interleave([p[i] for p in parts]) for i in range(2)) for parts in zip(*loaders)]
    done = stopped_at[0] * per_epoch + stopped_at[1]
    assert_same(rest, expected[done : (stopped_at[0] + 1) * per_epoch])


def test_a_position_from_other_data_is_refused(datasets_dir):
    state = module(datasets_dir).loader("train").state_dict()
    other = module(datasets_dir, batch_size=4).loader("train")
    with pytest.raises(ValueError, match=r"differ in batch_size \(8 -> 4\)"):
        other.load_state_dict(state)


def test_document_ids_follow_the_document_index(datasets_dir):
    """The loader reads a window's documents off its end tokens; the oracle is the prepared
    document index (``documents.npy``) searched at each token's position."""
    dm = module(datasets_dir, document_mask=True)
    train = dm.split_dataset("train")
    offsets = np.asarray(dm.stores["train"][0].offsets)
    batches = global_batches(dm, 1, range(1), steps=20)
    assert any(int(d.max()) > 0 for _, _, d in batches)  # rows do pack several documents
    for step, (inputs, targets, docs) in enumerate(batches):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row in range(B):
            _, window = train.window_of(step * B + row)
            positions = window * T + np.arange(T)
            index = np.searchsorted(offsets, positions, side="right")
            assert docs[row].tolist() == (index - index[0]).tolist()


def test_eod_mask_loss_stops_counting_the_target_after_each_document_end(datasets_dir):
    """``eod_mask_loss=true``: exactly the targets whose input is the end-of-document token are
    ``-100`` (Megatron's ``--eod-mask-loss``); everything else is the unmasked batch's."""
    plain = global_batches(module(datasets_dir), 1, range(1), steps=10)
    masked = global_batches(module(datasets_dir, eod_mask_loss=True), 1, range(1), steps=10)
    eos = module(datasets_dir).stores["train"][0].eos_token_id
    ends = 0
    for (x, y), (mx, my) in zip(plain, masked, strict=True):
        assert torch.equal(x, mx)
        at_end = x == eos
        ends += int(at_end.sum())
        assert torch.equal(my[at_end], torch.full_like(my[at_end], -100))
        assert torch.equal(my[~at_end], y[~at_end])
    assert ends > 0  # the windows do cross document ends


def test_validation_holds_whole_held_out_documents_in_order(datasets_dir):
    dm = module(datasets_dir)
    val = dm.split_dataset("validation")
    stream = np.concatenate([val[i][0][:-1] for i in range(len(val))])
    store = dm.stores["validation"][0]
    assert np.array_equal(stream, store.read(0, len(stream)))
    assert store.read(0, store.tokens)[-1] == 256 and store.documents >= 1


def test_the_tokenizer_and_sizes_are_checked_before_training(datasets_dir):
    with pytest.raises(DatasetError, match=r"prepared with the tokenizer bytes\+eos-v1.*prepared"):
        TokenDataModule(str(datasets_dir / "lower"), block_size=T, tokenizer=ByteTokenizer())
    TokenDataModule(str(datasets_dir / "lower"), block_size=T, tokenizer=ByteTokenizer(eos=True))
    with pytest.raises(DatasetError, match=r"fewer than one global batch of 4096"):
        TokenDataModule(str(datasets_dir / "lower"), block_size=T, batch_size=4096)


class SourceCounter(L.LightningModule):
    """Fits a scalar and counts, per training step, the windows of each source (by letters)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.upper = 0
        self.rows = 0

    def training_step(self, batch, batch_idx):
        inputs = batch[0]
        self.upper += int(((inputs >= 88) & (inputs <= 90)).any(dim=1).sum())
        self.rows += inputs.shape[0]
        return (self.w - inputs.float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_mixture_meets_its_weights_and_logs_what_it_met(datasets_dir, tmp_path):
    mix = {"lower": 0.7, "upper": 0.3}  # upper has a quarter of the windows: it repeats
    dm = TokenDataModule(str(datasets_dir), mix=mix, block_size=T, batch_size=50, seed=3)
    dm.setup()
    train = dm.split_dataset("train")
    windows = [train.window_of(g) for g in range(10_000)]
    share = np.mean([s for s, _ in windows])
    assert abs(share - 0.3) < 0.01  # Done-when: within 1 % over 10,000 windows
    assert abs(share - 0.3) <= 1 / 10_000  # by construction: within a window (2 sources)
    # every pass over a repeated source is a permutation of all its windows
    n_upper = train.windows[1]
    upper = [w for s, w in windows if s == 1][:n_upper]
    assert sorted(upper) == list(range(n_upper))

    trainer = L.Trainer(
        max_steps=200, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    counter = SourceCounter()
    trainer.fit(counter, datamodule=dm)
    assert counter.rows == 10_000
    counted = counter.upper / counter.rows  # by the windows' letters, not by the schedule
    assert abs(counted - 0.3) < 0.01
    logged = trainer.callback_metrics
    assert float(logged["data/mix/upper"]) == pytest.approx(counted, abs=1e-6)
    assert float(logged["data/mix/lower"]) == pytest.approx(1 - counted, abs=1e-6)


@pytest.mark.parametrize("n, replicas, shuffle", [(10, 4, True), (12, 4, False), (9, 2, True)])
def test_the_resumable_sampler_yields_distributed_sampler_indices(n, replicas, shuffle):
    for rank in range(replicas):
        for epoch in (0, 3):
            kw = dict(num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=True)
            ours, theirs = ResumableSampler(range(n), **kw), DistributedSampler(range(n), **kw)
            ours.set_epoch(epoch), theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            ours.resume_at(epoch, 1)
            assert list(ours) == list(theirs)[1:]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 1025, 4097])
def test_a_shuffle_is_a_seeded_bijection_without_a_table(n):
    order = Shuffle(n, [1, 0, 0])(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, Shuffle(n, [1, 0, 0])(np.arange(n)))  # the seed decides
    if n > 10:
        assert not np.array_equal(order, Shuffle(n, [1, 0, 1])(np.arange(n)))  # next pass


def test_a_mixture_schedule_spreads_each_source_evenly():
    weights = [0.5, 0.3, 0.15, 0.05]
    schedule = MixtureSchedule(list("abcd"), weights)
    src, k = schedule.locate(np.arange(20_000))
    for s in range(4):  # each source's windows are taken in its own order, none skipped
        assert np.array_equal(k[src == s], np.arange(int((src == s).sum())))
    running = np.cumsum(np.eye(4, dtype=np.int64)[src], axis=0)  # counts of every prefix
    n = np.arange(1, 20_001)[:, None]
    assert np.abs(running - n * np.array(weights)).max() <= 2  # ⌈log2 4⌉ windows
    for m in (0, 1, 17, 999, 20_000):
        assert np.array_equal(schedule.counts(m), np.bincount(src[:m], minlength=4))
