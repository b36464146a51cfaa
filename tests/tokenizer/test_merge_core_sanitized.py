"""The compiled merge loop under AddressSanitizer and UndefinedBehaviorSanitizer: built again
from ``_merge_core.c`` with ``-fsanitize=address,undefined``, it must learn what the Python loop
learns on random corpora (counts up to 10^6, ids past the surrogate block, merges that re-make
existing tokens, error paths) without one out-of-bounds access, use after free or undefined
operation. Slow (``make test-all``): a sanitized build and ~300 corpora take 1-4 minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import llmlab.tokenizer as tokenizer_package

pytestmark = pytest.mark.slow
SOURCE = Path(next(iter(tokenizer_package.__path__))) / "_merge_core.c"
REPO = Path(__file__).resolve().parents[2]  # the probe imports tests.tokenizer.corpus

PROBE = r"""
import importlib.util, random, sys
spec = importlib.util.spec_from_file_location("_merge_core", sys.argv[1])
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
import llmlab.tokenizer.merge_trainer as mt
from llmlab.tokenizer.merge_trainer import spell
from tests.tokenizer.corpus import learn_merges, random_merge_corpus

merges = 0
for seed in range(300):
    rng = random.Random(seed)
    words, counts = random_merge_corpus(rng, "abcdefgh", longest=40, words=rng.randint(1, 2000),
                                        counts=(1, 2, 3, 50, 10**6))
    vocab, min_frequency = rng.randint(5, 3000), rng.choice((0, 0, 2, 20))
    mt._merge_core = core
    compiled = learn_merges(words, counts, vocab, min_frequency)
    mt._merge_core = None
    assert compiled == learn_merges(words, counts, vocab, min_frequency), seed
    merges += len(compiled[0])
for words, counts in ((["ab"], [1, 2]), (["ab", 3], [1, 1]), (["ab"], ["x"])):
    try:
        core.train(words, counts, 2, 10, 0, lambda a, b: 2)
        raise SystemExit("bad input accepted")
    except (TypeError, ValueError):
        pass
tokens = [chr(0x10000 + i) for i in range(60000)]
high = [spell([59990 + (i % 7) for i in range(k, k + 12)]) for k in range(50)]
core.train(high, [3] * 50, 60000, 60100, 0, lambda a, b: (tokens.append(a), len(tokens) - 1)[1])
print("merges", merges)
"""


def _runtime(name: str) -> str | None:
    found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True)
    path = found.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_the_merge_loop_is_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the sanitized merge loop")
    runtimes = [_runtime("libasan.so"), _runtime("libubsan.so")]
    if None in runtimes:
        pytest.skip("gcc has no AddressSanitizer / UBSan runtime here")
    built = tmp_path / ("_merge_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-g", "-O1", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(built)],
        check=True,
    )  # fmt: skip
    env = {
        **os.environ,
        "LD_PRELOAD": ":".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0",  # the interpreter's own allocations at exit
        "PYTHONMALLOC": "malloc",  # every object through the sanitizer's allocator
    }
    run = subprocess.run([sys.executable, "-c", PROBE, str(built)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    report = run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "AddressSanitizer" not in run.stderr and "runtime error" not in run.stderr, report
    assert int(run.stdout.split()[-1]) > 100_000  # the corpora did train
