"""``LlmlabLM``: any llmlab decoder (the decoding contract) as an lm-evaluation-harness model.

lm-eval asks three questions; each is answered in batches through ``llmlab.decoding``'s
``ModelRunner`` and the model's KV cache:

* ``loglikelihood(context, continuation)``: ``Σ log p(continuation | context)`` and whether
  every continuation token is the argmax. Requests that share a context (the choices of a
  multiple-choice question) share one prefill: the context goes through the model once, the
  cache is repeated for each continuation (``reorder``), and only the continuations are fed.
  Contexts are left-padded to batch them, continuations right-padded (a later padding token
  never changes an earlier logit).
* ``loglikelihood_rolling(text)``: the text's total log-likelihood in disjoint windows of the
  model's context (lm-eval's ``get_rolling_token_windows``: the first token is conditioned on
  the prefix token, each later window on the token before it), as perplexity and bits per byte
  need.
* ``generate_until(context, until=...)``: greedy (or sampled) continuations from
  ``llmlab.decoding.generate``, cut at the first stop string.

Tokenisation follows lm-eval's ``TemplateLM`` (trailing spaces of a context move to the
continuation; the continuation's tokens are those of ``context + continuation`` after the
context's), so the same requests give the same tokens as its ``hf`` model on the exported
folder. The prefix token for an empty context is the tokenizer's EOS / BOS (as the exported
``tokenizer_config.json`` names them); the byte-level tokenizer has neither, so it is ``\\n``
(a document boundary in the training text).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor

from llmlab.decoding import GenerationConfig, generate
from llmlab.decoding.runner import ModelRunner

GENERATION_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}


class LlmlabLM(TemplateLM):
    """``LlmlabLM(model, tokenizer, batch_size=16)``: see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int = 16,
        max_length: int | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int = 64,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.tok = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or model.config.block_size
        self.max_gen_toks = max_gen_toks
        self._prefix = prefix_token_id if prefix_token_id is not None else self._default_prefix()

    def _default_prefix(self) -> int:
        """EOS, else BOS, as the exported tokenizer_config.json names them (so lm-eval's ``hf``
        model on the export uses the same token); else a newline."""
        for name in ("eos_token_id", "bos_token_id"):
            value = getattr(self.tok, name, None)
            if isinstance(value, int):
                return value
        specials = getattr(self.tok, "special_tokens", None)
        if specials:
            from llmlab.tokenizer.hf_folder import HFTokenizerFiles

            roles = HFTokenizerFiles(self.tok).special_token_roles()
            for role in ("eos_token", "bos_token"):
                if role in roles:
                    return specials[roles[role]]
        newline = self.tok_encode("\n")
        if len(newline) != 1:
            raise ValueError(
                "the tokenizer has no EOS/BOS and '\\n' is not one token: pass prefix_token_id"
            )
        return newline[0]

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        if getattr(self.tok, "special_tokens", None):  # special-token text maps to its id, as HF
            return list(self.tok.encode(string, allowed_special="all"))
        return list(self.tok.encode(string))

    # ------------------------------------------------------------------ log-likelihoods
    @torch.inference_mode()
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """``(log p, greedy)`` per ``(key, context ids, continuation ids)`` (module docstring)."""
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            window = (context + continuation)[-(self.max_length + 1) :][:-1]
            n = min(len(continuation), len(window))
            groups[tuple(window[: len(window) - n + 1])].append((i, continuation[-n:]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for batch in self._batches(sorted(groups.items(), key=lambda kv: -len(kv[0]))):
            for i, value in self._score(batch):
                results[i] = value
        return results

    def _batches(self, groups: list[Any]) -> list[list[Any]]:
        """Groups packed into batches of at most ``batch_size`` continuations whose longest
        context plus longest continuation fits the model's context; groups with one
        continuation and groups that share a context go to separate batches."""
        batches: list[list[Any]] = []
        rows = ctx = cont = 0
        shared = None
        for context, items in groups:
            longest = max(len(c) for _, c in items) - 1
            fits = max(ctx, len(context)) + max(cont, longest) <= self.max_length
            same_kind = shared == (len(items) > 1)
            if batches and same_kind and rows + len(items) <= self.batch_size and fits:
                batches[-1].append((context, items))
                rows, ctx, cont = rows + len(items), max(ctx, len(context)), max(cont, longest)
            else:
                batches.append([(context, items)])
                rows, ctx, cont, shared = len(items), len(context), longest, len(items) > 1
        return batches

    def _score(self, batch: list[tuple[tuple[int, ...], list[tuple[int, list[int]]]]]) -> list[Any]:
        """``(request index, (log p, greedy))`` for each continuation of ``batch``."""
        rows = [(g, i, cont) for g, (_, items) in enumerate(batch) for i, cont in items]
        if len(rows) == len(batch):  # one continuation per context: one forward, no cache
            windows = [list(ctx) + cont[:-1] for (ctx, _), (_, _, cont) in zip(batch, rows)]
            ids, mask = left_pad(windows)
            keep = max(len(cont) for _, _, cont in rows)
            runner = ModelRunner(self.model, len(rows), ids.shape[1], use_cache=False,
                                 attention_mask=mask)  # fmt: skip
            logps = runner.feed(ids, keep=keep).log_softmax(-1)  # (rows, keep, V), right-aligned
            return [
                _scored(i, logps[r, keep - len(cont) :], cont)
                for r, (_, i, cont) in enumerate(rows)
            ]
        # Shared contexts: prefill each once, repeat its cache per continuation, feed those.
        ids, mask = left_pad([list(c) for c, _ in batch])
        longest = max(len(cont) for _, _, cont in rows) - 1
        runner = ModelRunner(self.model, len(batch), ids.shape[1] + longest, attention_mask=mask)
        first = runner.feed(ids, keep=1).log_softmax(-1)[:, 0]  # (groups, V): the first tokens
        rest = None
        if longest > 0:
            runner.reorder(torch.tensor([g for g, _, _ in rows]))
            feed = torch.zeros(len(rows), longest, dtype=torch.long)
            for r, (_, _, cont) in enumerate(rows):
                feed[r, : len(cont) - 1] = torch.tensor(cont[:-1])
            rest = runner.feed(feed, keep=longest).log_softmax(-1)  # (rows, longest, V)
        out = []
        for r, (g, i, cont) in enumerate(rows):
            logps = first[g : g + 1]
            if len(cont) > 1:
                logps = torch.cat([logps, rest[r, : len(cont) - 1]])
            out.append(_scored(i, logps, cont))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length`` tokens."""
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(text), self._prefix, self.max_length, 1),
            ):
                windows.append((None, context, continuation))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += logp
        return totals

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations cut at the first ``until`` string, batched by identical settings."""
        by_settings: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for k, (context, settings) in enumerate(req.args for req in requests):
            unknown = sorted(set(settings) - GENERATION_KEYS)
            if unknown:
                raise ValueError(f"generate_until: unsupported generation setting(s) {unknown}")
            by_settings[json.dumps(settings, sort_keys=True)].append((k, context))
        out = [""] * len(requests)
        for key, items in by_settings.items():
            settings = json.loads(key)
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = settings.get("max_gen_toks", self.max_gen_toks)
            sampling = {k: settings[k] for k in ("temperature", "top_k", "top_p") if k in settings}
            do_sample = bool(settings.get("do_sample", False)) and sampling.get("temperature") != 0
            config = GenerationConfig(
                max_new_tokens=new,
                do_sample=do_sample,
                **(sampling if do_sample else {}),
                stop_strings=until or None,
                pad_token_id=self._prefix,
                seed=0,
            )
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                prompts = [self.tok_encode(c)[-(self.max_length - new) :] for _, c in chunk]
                ids, mask = left_pad(prompts)
                tokens = generate(self.model, ids, config, attention_mask=mask, tokenizer=self.tok)
                for (k, _), row in zip(chunk, tokens[:, ids.shape[1] :].tolist()):
                    text = self.tok.decode(row)
                    for stop in until:
                        text = text.split(stop)[0]
                    out[k] = text
        return out


def _scored(index: int, logps: Tensor, continuation: list[int]) -> tuple[int, Any]:
    """(index, (Σ log p of the continuation, whether each of its tokens is the argmax)); the sum
    in float64, so a long continuation's total does not drift with its length."""
    target = torch.tensor(continuation)
    logp = logps.gather(1, target[:, None]).double().sum().item()
    return index, (logp, bool((logps.argmax(-1) == target).all()))


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[Tensor, Tensor]:
    """(ids, attention mask), each (len(rows), longest), padded on the left."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, longest - len(r) :] = 1
    return ids, mask
