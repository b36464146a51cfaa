"""Which drafts the target keeps: the step's ``k + 1`` rows of target logits against ``k`` drafts.

Row ``i`` holds the target's logits after the sequence's tokens and the first ``i`` drafts.
Each row goes through the request's own processors with that context
(``llmlab.serving.sampler.processed_scores``: penalties see the drafts before it, exactly as
they would see those tokens had they been decoded one by one), then:

* **greedy**: draft ``i`` is kept while it equals the row's argmax; the first row whose argmax
  differs gives its argmax instead, and if all ``k`` are kept the last row gives one more. The
  tokens are plain greedy decoding's, whatever the drafts were.
* **sampling** (Leviathan et al. 2023; Chen et al. 2023): with ``p`` the row's distribution and
  ``q`` the one the draft was drawn from, draft ``d`` is kept with probability
  ``min(1, p(d) / q(d))``; at the first rejection a token is drawn from ``max(0, p - q)``
  renormalised, and after ``k`` acceptances a bonus token from the last row's ``p``. Every
  token is then distributed exactly as ``p`` (the sum over ``d`` of ``q(d) min(1, p(d)/q(d))``
  plus the rejection mass times the residual is ``p``). An n-gram's or a greedy draft's ``q``
  is a point mass on ``d``: kept with probability ``p(d)``, else drawn from ``p`` without ``d``.

Random numbers come from the sequence's own generator, so a seeded request is reproducible
(not the same tokens as without speculation: the draws differ, their distribution does not).
A raise fails the request alone, as a raise while choosing one token does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmlab.serving.sampler import Failure, Rules, processed_scores
from llmlab.serving.sequence import Sequence


def verify(
    seq: Sequence, rules: Rules, logits: Tensor, drafts: list[int], probs: Tensor | None
) -> list[int] | Failure:
    """The tokens the target emits after ``seq`` given ``drafts``: the kept drafts, then the
    target's own token (a correction, or a bonus after all were kept). ``logits`` (k+1, V)."""
    stage = ["logits"]
    try:
        if rules.plain:
            return _greedy(logits.max(dim=-1).indices.tolist(), drafts)
        return _verify(seq, rules, logits, drafts, probs, stage)
    except Exception as err:  # isolated: reported as this request's error
        return Failure(stage[0], err)


def _greedy(picks: list[int], drafts: list[int]) -> list[int]:
    out = []
    for i, best in enumerate(picks):
        out.append(best)
        if i == len(drafts) or best != drafts[i]:
            break
    return out


def _verify(
    seq: Sequence,
    rules: Rules,
    logits: Tensor,
    drafts: list[int],
    probs: Tensor | None,
    stage: list[str],
) -> list[int]:
    out: list[int] = []
    k = len(drafts)
    for i in range(k + 1):
        context = seq.token_ids + drafts[:i]
        scores = processed_scores(context, rules, logits[i : i + 1], stage)[0]
        if not rules.sample:
            out.append(int(scores.argmax()))
            if i < k and out[-1] == drafts[i]:
                continue
            return out
        p = torch.softmax(scores, dim=-1)
        if i == k:  # every draft kept: a bonus token from the target
            out.append(_draw(p, seq))
            return out
        d = drafts[i]
        q = probs[i] if probs is not None else None
        q_d = float(q[d]) if q is not None else 1.0
        p_d = float(p[d])
        u = float(torch.rand((), generator=seq.generator, device=p.device))
        if q_d > 0 and u < p_d / q_d:  # min(1, .) is implied: u < 1
            out.append(d)
            continue
        if q is not None:
            residual = (p - q).clamp(min=0)
        else:
            residual = p.index_fill(0, torch.tensor([d], device=p.device), 0.0)
        total = float(residual.sum())
        out.append(_draw(residual / total if total > 0 else p, seq))
        return out
    return out


def _draw(p: Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(p, 1, generator=seq.generator))
