"""EM training of a Unigram model, after SentencePiece's trainer.

1. Count words (normalized text split before each ``▁``) and seed the vocabulary with every
   character plus the most frequent substrings (ranked by ``frequency × length``).
2. E-step: for each distinct word, forward-backward over its segmentation lattice gives each
   piece's expected count ``E[c(x)] = Σ_w n_w Σ_{edges of x} exp(α_i + log p(x) + β_j - log Z_w)``.
3. M-step: ``log p(x) = ψ(E[c(x)]) - ψ(Σ E[c])`` (the Bayesian/digamma update sentencepiece uses),
   dropping pieces expected less than 0.5 times.
4. Prune: each piece's *loss* is the drop in likelihood if its Viterbi count were given to its
   best alternative segmentation; keep the ``shrinking_factor`` best (characters always stay).
5. Repeat until the vocabulary is within 10% of the target, then keep the best-scoring pieces.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from llmlab.tokenizer.metaspace import SPACE, normalize
from llmlab.tokenizer.progress import Progress

EXPECTED_FREQUENCY_THRESHOLD = 0.5


def digamma(x: float) -> float:
    result = 0.0
    while x < 6.0:
        result -= 1.0 / x
        x += 1.0
    f = 1.0 / (x * x)
    return (
        result
        + math.log(x)
        - 0.5 / x
        - f * (1.0 / 12 - f * (1.0 / 120 - f * (1.0 / 252 - f * (1.0 / 240 - f / 132))))
    )


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if a > b:
        return a + math.log1p(math.exp(b - a))
    return b + math.log1p(math.exp(a - b))


def _edges(word: str, scores: dict[str, float], prefixes: set[str], max_len: int):
    n = len(word)
    out = []
    for i in range(n):
        for j in range(i + 1, min(n, i + max_len) + 1):
            sub = word[i:j]
            if sub not in prefixes:
                break
            if sub in scores:
                out.append((i, j, sub))
    return out


def _viterbi(
    word: str, scores: dict[str, float], prefixes: set[str], max_len: int, exclude: str = ""
):
    n = len(word)
    best = [-math.inf] * (n + 1)
    back: list[tuple[int, str]] = [(-1, "")] * (n + 1)
    best[0] = 0.0
    for i in range(n):
        if best[i] == -math.inf:
            continue
        for j in range(i + 1, min(n, i + max_len) + 1):
            sub = word[i:j]
            if sub not in prefixes:
                break
            s = scores.get(sub)
            if s is None or sub == exclude:
                continue
            if best[i] + s > best[j]:
                best[j], back[j] = best[i] + s, (i, sub)
    if best[n] == -math.inf:
        return []
    pieces, j = [], n
    while j > 0:
        i, sub = back[j]
        pieces.append(sub)
        j = i
    pieces.reverse()
    return pieces


class _Model:
    def __init__(self, scores: dict[str, float], max_piece_length: int):
        self.scores = scores
        self.max_len = min(max((len(p) for p in scores), default=1), max_piece_length)
        self.prefixes = {p[:k] for p in scores for k in range(1, len(p) + 1)}


def _em_step(
    words: list[str],
    counts: list[int],
    edges_of: list[list[tuple[int, int, str]]],
    scores: dict[str, float],
    required: set[str],
) -> dict[str, float]:
    """One EM iteration. Short words are done in probability space (no log-sum-exp per edge:
    a 40-character word has probability >= e^-40*18, far above float underflow); longer
    words fall back to log space."""
    expected: dict[str, float] = dict.fromkeys(scores, 0.0)
    prob = {p: math.exp(s) for p, s in scores.items()}
    for word, count, edges in zip(words, counts, edges_of):
        n = len(word)
        edges = [e for e in edges if e[2] in prob]
        if n <= 40:
            alpha = [0.0] * (n + 1)
            alpha[0] = 1.0
            for i, j, sub in edges:  # sorted by start: alpha[i] is final when used
                alpha[j] += alpha[i] * prob[sub]
            beta = [0.0] * (n + 1)
            beta[n] = 1.0
            for i, j, sub in reversed(edges):
                beta[i] += prob[sub] * beta[j]
            z = alpha[n]
            if z <= 0.0:
                continue
            scale = count / z
            for i, j, sub in edges:
                expected[sub] += scale * alpha[i] * prob[sub] * beta[j]
            continue
        la = [-math.inf] * (n + 1)
        la[0] = 0.0
        for i, j, sub in edges:
            la[j] = _logaddexp(la[j], la[i] + scores[sub])
        lb = [-math.inf] * (n + 1)
        lb[n] = 0.0
        for i, j, sub in reversed(edges):
            lb[i] = _logaddexp(lb[i], scores[sub] + lb[j])
        z = la[n]
        if z == -math.inf:
            continue
        for i, j, sub in edges:
            expected[sub] += count * math.exp(la[i] + scores[sub] + lb[j] - z)
    kept = {p: c for p, c in expected.items() if c >= EXPECTED_FREQUENCY_THRESHOLD or p in required}
    total = digamma(sum(kept.values()))
    return {p: digamma(max(c, 1e-6)) - total for p, c in kept.items()}


def _prune(
    words: list[str],
    counts: list[int],
    model: _Model,
    required: set[str],
    target: int,
    shrink: float,
) -> dict[str, float]:
    scores = model.scores
    freq: Counter[str] = Counter()
    inverted: Counter[str] = Counter()  # piece -> sum of counts of the words using it
    vsum = 0
    for word, count in zip(words, counts):
        vsum += count
        for piece in _viterbi(word, scores, model.prefixes, model.max_len):
            freq[piece] += count
            inverted[piece] += count
    total = sum(freq.values())
    logsum = math.log(total)
    keep: dict[str, float] = {}
    candidates = []
    for piece, score in scores.items():
        f = freq.get(piece, 0)
        if piece in required:
            keep[piece] = score
            continue
        if f == 0:
            continue
        alternatives = _viterbi(piece, scores, model.prefixes, model.max_len, exclude=piece)
        if not alternatives:
            keep[piece] = score
            continue
        share = inverted[piece] / vsum
        logprob = math.log(f) - logsum
        logsum_alt = math.log(total + f * (len(alternatives) - 1))
        logprob_alt = sum(math.log(freq.get(a, 0) + f) - logsum_alt for a in alternatives)
        candidates.append((-(share * (logprob - logprob_alt)), piece))
    candidates.sort()
    size = max(target, int(shrink * len(scores)))
    for _, piece in candidates:
        if len(keep) >= size:
            break
        keep[piece] = scores[piece]
    return keep


def train_unigram(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = ("<s>", "</s>"),
    unk_token: str = "<unk>",
    max_piece_length: int = 16,
    seed_size: int | None = None,
    shrinking_factor: float = 0.75,
    num_sub_iterations: int = 2,
    normalization: str = "nfkc",
    add_dummy_prefix: bool = True,
    remove_extra_whitespaces: bool = True,
    show_progress: bool = False,
) -> tuple[list[tuple[str, float]], int]:
    """(pieces, reserved): ``vocab_size`` pieces with their scores, ``<unk>`` then the special
    (control) tokens (``reserved`` of them together), then the learned pieces by descending
    score; ``UnigramTokenizer.train`` builds the tokenizer from them."""
    word_counts: Counter[str] = Counter()
    for text in texts:
        for line in text.split("\n"):
            norm = normalize(line, normalization, remove_extra_whitespaces, add_dummy_prefix)
            for word in norm.split(SPACE):
                if word:
                    word_counts[SPACE + word] += 1
            if norm and not norm.startswith(SPACE):
                # without a dummy prefix the first word has no boundary mark: undo the prefix
                first = norm.split(SPACE)[0]
                word_counts[SPACE + first] -= 1
                word_counts[first] += 1
    word_counts = Counter({w: c for w, c in word_counts.items() if c > 0})
    words, counts = list(word_counts), list(word_counts.values())

    char_counts: Counter[str] = Counter()
    for word, count in zip(words, counts):
        for ch in word:
            char_counts[ch] += count
    required = set(char_counts)
    reserved = 1 + len(special_tokens)
    if vocab_size < reserved + len(required):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {reserved} reserved pieces (<unk> + special "
            f"tokens) and {len(required)} distinct characters need at least "
            f"{reserved + len(required)}"
        )

    substrings: Counter[str] = Counter()
    for word, count in zip(words, counts):
        n = len(word)
        for i in range(n):
            for j in range(i + 2, min(n, i + max_piece_length) + 1):
                substrings[word[i:j]] += count
    seed_size = seed_size or 8 * vocab_size
    ranked = sorted(
        (s for s, c in substrings.items() if c > 1), key=lambda s: (-substrings[s] * len(s), s)
    )[:seed_size]
    seed = {**{c: char_counts[c] for c in required}, **{s: substrings[s] for s in ranked}}
    total = math.log(sum(seed.values()))
    scores = {p: math.log(c) - total for p, c in seed.items()}
    substrings.clear()

    target = vocab_size - reserved
    desired = int(target * 1.1)
    progress = Progress("unigram EM", 0, show_progress)
    while True:
        model = _Model(scores, max_piece_length)
        edges_of = [_edges(w, scores, model.prefixes, model.max_len) for w in words]
        for _ in range(num_sub_iterations):
            scores = _em_step(words, counts, edges_of, scores, required)
            progress.update()
        if len(scores) <= desired:
            break
        scores = _prune(
            words, counts, _Model(scores, max_piece_length), required, desired, shrinking_factor
        )
    progress.close()

    # Finalize: every character, then the best-scoring pieces, sorted by score (sentencepiece).
    ordered = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    final: dict[str, float] = {}
    min_score = min(scores.values())
    for ch in sorted(required, key=lambda c: (-char_counts[c], c)):
        final[ch] = scores.get(ch, min_score - 1.0)
    for piece, score in ordered:
        if len(final) >= target:
            break
        final.setdefault(piece, score)
    pieces = [(unk_token, 0.0), *((s, 0.0) for s in special_tokens)]
    pieces += sorted(final.items(), key=lambda kv: (-kv[1], kv[0]))
    return pieces, reserved
