"""Write the ``shakespeare_cloze`` multiple-choice task shipped with llmlab.train's evaluation.

Each item is a passage of a held-out work (the validation split: no model trained by
``make train`` has seen it) and four candidate next lines: the true one and three lines of
similar length drawn from the other held-out works. A model that has learnt Shakespeare's
language (metre, speaker turns, spelling of the Folio) picks the true line more often than
chance (25 %). Deterministic (seed 0): rerunning rewrites the same file.

    python scripts/make_shakespeare_cloze.py [N_ITEMS]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from llmlab.train.data import corpus_files

OUT = (
    Path(__file__).resolve().parents[1]
    / "packages/train/src/llmlab/train/evaluation/tasks/shakespeare_cloze.jsonl"
)


def main(n_items: int = 100) -> None:
    rng = random.Random(0)
    works = {Path(f).stem: Path(f).read_text(encoding="utf-8").split("\n") for f in
             corpus_files("shakespeare")["validation"]}  # fmt: skip
    pool = [(w, line) for w, lines in works.items() for line in lines if 25 <= len(line) <= 70]
    items = []
    while len(items) < n_items:
        work = rng.choice(sorted(works))
        lines = works[work]
        i = rng.randrange(8, len(lines))
        answer = lines[i]
        context_lines = lines[i - 6 : i]
        if not 25 <= len(answer) <= 70 or any(not line.strip() for line in context_lines[-2:]):
            continue
        near = [s for w, s in pool if w != work and abs(len(s) - len(answer)) <= 10]
        choices = [answer, *rng.sample(near, 3)]
        rng.shuffle(choices)
        items.append({"work": work, "context": "\n".join(context_lines) + "\n",
                      "choices": choices, "label": choices.index(answer)})  # fmt: skip
    OUT.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"wrote {len(items)} items to {OUT}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
