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

PROBE = r"""
import importlib.util, random, sys
from operator import add
spec = importlib.util.spec_from_file_location("_merge_core", sys.argv[1])
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
import llmlab.tokenizer.merge_trainer as mt
from llmlab.tokenizer.merge_trainer import spell

def learn(words, counts, vocab, min_frequency, loop):
    mt._merge_core = loop
    tokens = sorted(set("".join(words))) + ["ab", "ba", "aab", "cd"]
    ids = {t: i for i, t in enumerate(tokens)}
    spelled = [spell([ids[c] for c in w]) for w in words]
    return mt.train_merges(spelled, list(counts), tokens, vocab, add, min_frequency), tokens

merges = 0
for seed in range(300):
    rng = random.Random(seed)
    alphabet = "abcdefgh"[: rng.randint(1, 8)]
    words = sorted({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
                    for _ in range(rng.randint(1, 2000))})
    counts = [rng.choice((1, 2, 3, 50, 10**6)) for _ in words]
    vocab, min_frequency = rng.randint(5, 3000), rng.choice((0, 0, 2, 20))
    compiled = learn(words, counts, vocab, min_frequency, core)
    assert compiled == learn(words, counts, vocab, min_frequency, None), seed
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
    run = subprocess.run([sys.executable, "-c", PROBE, str(built)], env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    report = run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "AddressSanitizer" not in run.stderr and "runtime error" not in run.stderr, report
    assert int(run.stdout.split()[-1]) > 100_000  # the corpora did train
