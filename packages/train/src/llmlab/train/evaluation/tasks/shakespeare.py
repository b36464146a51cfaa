"""The documents of llmlab's lm-eval tasks, read from files that install with llmlab (no
download): the held-out works of the training corpus, and the shipped cloze items."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def held_out_works(max_chars: int | None = None, **metadata: Any) -> Any:
    """The validation split of ``make train``'s corpus: one document per held-out work, its
    text exactly as the file holds it (``max_chars`` keeps each work's first characters, for a
    quick run)."""
    import datasets

    from llmlab.train.data import corpus_files

    docs = []
    for file in corpus_files("shakespeare")["validation"]:
        with open(file, encoding="utf-8", newline="") as f:
            text = f.read()
        docs.append({"title": Path(file).stem, "text": text[:max_chars] if max_chars else text})
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs)})


def perplexity_results(doc: dict[str, Any], results: list[float]) -> dict[str, Any]:
    """lm-eval's (log-likelihood, count) pairs: per word, per byte and bits per byte."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    size = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, size),
        "bits_per_byte": (loglikelihood, size),
    }


def cloze(**metadata: Any) -> Any:
    """``shakespeare_cloze.jsonl``: a held-out passage and four candidate next lines."""
    import datasets

    lines = (HERE / "shakespeare_cloze.jsonl").read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict(
        {"validation": datasets.Dataset.from_list([json.loads(line) for line in lines])}
    )
