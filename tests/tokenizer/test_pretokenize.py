"""Two-level word counting (``pretokenize``): counting whitespace-separated tokens first and
splitting each distinct one once must give exactly the counts of splitting every text, for each
splitter that uses it, on text full of the cases that could tell them apart (str.split's extra
separators U+001C..U+001F, Unicode spaces, "▁", leading/trailing/double spaces, CR LF, lone
surrogates), and when files are read in blocks instead of lines."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmlab.tokenizer.patterns import compiled, resolve_pattern
from llmlab.tokenizer.pretokenize import (
    WHITESPACE_BOUNDED,
    FileLines,
    count_chunks,
    iter_file_lines,
)
from llmlab.tokenizer.sp_bpe_train import SentenceWords
from llmlab.tokenizer.sp_normalizer import SentencePieceNormalizer
from llmlab.tokenizer.wordpiece import BertWords, WordPieceTokenizer
from tests.tokenizer.corpus import MIXED

TRICKY = list("ab Z9  \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u2000\u3000\u2581,.!'é\u0301中Σ")
TEXTS = st.lists(
    st.one_of(
        st.lists(st.sampled_from([*TRICKY, "  ", "\r\n", "\ud800"]), max_size=30).map("".join),
        st.text(max_size=20),
    ),
    max_size=40,
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def splitters() -> dict[str, object]:
    out: dict[str, object] = {p: p for p in sorted(WHITESPACE_BOUNDED)}
    out["bert"] = BertWords(WordPieceTokenizer(["[UNK]"]))
    out["bert-raw"] = BertWords(WordPieceTokenizer(["[UNK]"], clean_text=False, lowercase=False))
    out["sentencepiece"] = SentenceWords(SentencePieceNormalizer())
    out["sentencepiece-no-prefix"] = SentenceWords(SentencePieceNormalizer(add_dummy_prefix=False))
    return out


SPLITTERS = splitters()


def one_by_one(texts: list[str], splitter) -> Counter[str]:
    """The definition: every text split on its own, every chunk counted."""
    split = compiled(splitter).findall if isinstance(splitter, str) else splitter
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(split(text))
    return counts


@pytest.mark.parametrize("name", sorted(SPLITTERS))
@SETTINGS
@given(texts=TEXTS)
def test_two_level_counts_equal_splitting_each_text(name, texts):
    splitter = SPLITTERS[name]
    assert count_chunks(texts, splitter) == one_by_one(texts, splitter)


@pytest.mark.parametrize("name", sorted(SPLITTERS))
def test_mixed_corpus_by_lines(name):
    lines = MIXED.splitlines(keepends=True) * 3 + ["a\x1cb c", "x\u2581y  z ", " ▁ "]
    assert count_chunks(lines, SPLITTERS[name]) == one_by_one(lines, SPLITTERS[name])


@pytest.mark.parametrize("name", sorted(SPLITTERS))
def test_file_blocks_count_like_lines(tmp_path, name):
    """``FileLines`` read in blocks (line-agnostic splitters) count as the lines do."""
    paths = []
    for i, text in enumerate([MIXED * 50, "a\x1cb\r\nc  d\n" * 3000 + "no newline at the end"]):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_bytes(text.encode("utf-8"))
    blocks = list(FileLines(paths).blocks(size=1000))
    assert "".join(blocks) == "".join(iter_file_lines(paths))
    assert len(blocks) > 10 and all(b.endswith("\n") for b in blocks[:3])
    splitter = SPLITTERS[name]
    expected = one_by_one(list(iter_file_lines(paths)), splitter)
    assert count_chunks(FileLines(paths), splitter) == expected


def test_file_parts_hold_every_line_once(tmp_path):
    """``FileLines.part``: consecutive byte ranges, cut anywhere (inside a line, inside a UTF-8
    sequence, on a newline), give the file's lines in order, each once."""
    path = tmp_path / "f.txt"
    text = "é中\n\nab\r\ncd\n" * 40 + MIXED + "tail without newline"
    path.write_bytes(text.encode("utf-8"))
    size = path.stat().st_size
    lines = list(iter_file_lines([path]))
    for cuts in ([0, size], [0, 1, size], [0, 2, 3, 4, size], [*range(0, size, 7), size]):
        got = [ln for a, b in pairwise(cuts) for ln in FileLines.part(str(path), a, b)]
        assert got == lines, cuts
        blocks = [x for a, b in pairwise(cuts) for x in FileLines.part(str(path), a, b, False)]
        assert "".join(blocks) == text


@pytest.mark.parametrize("name", [*sorted(WHITESPACE_BOUNDED), "bert", "gpt4"])
def test_files_counted_by_parts_in_two_processes_equal_one(tmp_path, name):
    """``workers=2`` on files: each process reads its own part; the counts equal one process's."""
    paths = []
    for i, text in enumerate([MIXED * 20, "a\x1cb\r\nc  d\n" * 500 + "no newline at the end", ""]):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_bytes(text.encode("utf-8"))
    splitter = SPLITTERS.get(name) or resolve_pattern(name)
    expected = one_by_one(list(iter_file_lines(paths)), splitter)
    assert count_chunks(FileLines(paths), splitter, workers=2) == expected


def _forked_slices(name: str) -> tuple[bool, list, list[str]]:
    """In a fresh process (no threads another test left running, which rightly stop
    ``count_chunks`` from forking): whether ``workers=3`` counts equal one process's, the
    slices it took, and the texts."""
    from llmlab.tokenizer import pretokenize

    lines = MIXED.splitlines(keepends=True) * 4 + ["a\x1cb c", "x\u2581y  z ", " ▁ ", ""]
    splitter = SPLITTERS.get(name) or resolve_pattern(name)
    real, taken = pretokenize._list_parts, []
    pretokenize._list_parts = lambda t, w: taken.append(real(t, w)) or taken[-1]
    same = pretokenize.count_chunks(lines, splitter, workers=3) == one_by_one(lines, splitter)
    return same, taken, lines


@pytest.mark.parametrize("name", [*sorted(SPLITTERS), "gpt4"])
def test_a_list_counted_in_forked_slices_equals_one_process(name):
    """``workers=3`` on a list of texts: each forked process counts its slice (inherited, not
    shipped); the counts equal one process's, and the slices, taken, hold every text once."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")  # its workers may fork (a Pool's may not)
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        same, taken, lines = pool.submit(_forked_slices, name).result()
    assert same
    [parts] = taken
    assert len(parts) == 3 and [t for [part] in parts for t in part] == lines
