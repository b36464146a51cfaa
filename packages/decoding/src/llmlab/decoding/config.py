"""``GenerationConfig``: every decoding knob in one dataclass, with HF ``generate``'s field names.

Keeping HF's names (and its defaults where they make sense) means a config can be copied between
``llmlab.decoding.generate`` and ``transformers`` ``model.generate`` unchanged, which is exactly
what the parity tests do. ``validate()`` rejects contradictory settings before any forward pass,
naming the bad value and what would be valid.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

EARLY_STOPPING_MODES = (True, False, "never")
STRATEGIES = ("auto", "greedy", "sample", "beam", "exhaustive", "speculative")


@dataclass
class GenerationConfig:
    """How to decode. Fields mirror ``transformers.GenerationConfig`` (same names, same meaning).

    ``strategy`` picks the algorithm explicitly; ``"auto"`` follows HF: ``num_beams > 1`` means
    beam search, otherwise ``do_sample`` chooses sampling or greedy (speculative decoding is
    chosen by passing a ``draft_model`` to ``generate``).
    """

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables (HF's default of 50 only makes sense for large vocabularies)
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    stop_strings: str | list[str] | None = None
    seed: int | None = None
    use_cache: bool = True
    strategy: str = "auto"
    # speculative decoding: tokens the draft proposes per verification step
    num_assistant_tokens: int = 4
    # exhaustive search: refuse when vocab_size ** max_new_tokens exceeds this
    max_exhaustive_candidates: int = 200_000
    # generation past the model's context (greedy and sampling): the model sees at most
    # sliding_window tokens; when full, the context restarts at the last
    # sliding_window - window_stride + 1 tokens, re-encoded (stride 1: nanoGPT's crop)
    sliding_window: int | None = None
    window_stride: int = 1

    # ------------------------------------------------------------------ derived views
    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a (possibly empty) list."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    @property
    def stop_string_list(self) -> list[str]:
        if self.stop_strings is None:
            return []
        if isinstance(self.stop_strings, str):
            return [self.stop_strings]
        return list(self.stop_strings)

    @property
    def effective_pad_token_id(self) -> int:
        """HF's fallback: no ``pad_token_id`` means "pad with the first eos id"."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        if self.eos_token_ids:
            return self.eos_token_ids[0]
        return 0

    def resolved_strategy(self, has_draft: bool = False) -> str:
        if self.strategy != "auto":
            return self.strategy
        if has_draft:
            return "speculative"
        if self.num_beams > 1:
            return "beam"
        return "sample" if self.do_sample else "greedy"

    def replace(self, **changes: Any) -> GenerationConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Fail early, naming the bad value and what would be valid."""

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"GenerationConfig: {message}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(
            is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
        )
        need(
            is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
            f"got {self.min_new_tokens!r}",
        )
        need(
            isinstance(self.temperature, (int, float)) and self.temperature > 0,
            f"temperature must be > 0 (use do_sample=False for greedy), got {self.temperature!r}",
        )
        need(
            is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}",
        )
        need(
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}",
        )
        need(
            self.min_p is None or (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1),
            f"min_p must be None or in [0, 1], got {self.min_p!r}",
        )
        need(
            isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}",
        )
        need(
            is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
            f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}",
        )
        need(
            is_int(self.num_beams) and self.num_beams >= 1,
            f"num_beams must be an integer >= 1, got {self.num_beams!r}",
        )
        need(
            isinstance(self.early_stopping, bool) or self.early_stopping == "never",
            f"early_stopping must be one of {list(EARLY_STOPPING_MODES)}, "
            f"got {self.early_stopping!r}",
        )
        need(
            is_int(self.num_return_sequences) and self.num_return_sequences >= 1,
            f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}",
        )
        need(
            self.strategy in STRATEGIES,
            f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}",
        )
        strategy = self.resolved_strategy()
        if strategy == "beam" or (strategy == "auto" and self.num_beams > 1):
            need(
                self.num_return_sequences <= self.num_beams,
                f"num_return_sequences={self.num_return_sequences} must be <= "
                f"num_beams={self.num_beams} for beam search (a beam search returns its n best)",
            )
        if strategy == "greedy":
            need(
                self.num_return_sequences == 1,
                f"greedy decoding returns one sequence per prompt; num_return_sequences="
                f"{self.num_return_sequences} needs do_sample=True or num_beams >= it",
            )
        if strategy == "beam":
            need(
                self.num_beams > 1,
                "strategy='beam' needs num_beams > 1, got num_beams=1",
            )
        if strategy in ("greedy", "sample") and self.strategy != "auto":
            need(
                self.num_beams == 1,
                f"strategy={strategy!r} decodes one hypothesis; num_beams={self.num_beams} "
                f"needs strategy='beam'",
            )
        for eos in self.eos_token_ids:
            need(is_int(eos) and eos >= 0, f"eos_token_id entries must be ids >= 0, got {eos!r}")
        need(
            self.pad_token_id is None or (is_int(self.pad_token_id) and self.pad_token_id >= 0),
            f"pad_token_id must be None or an id >= 0, got {self.pad_token_id!r}",
        )
        for s in self.stop_string_list:
            need(isinstance(s, str) and s != "", f"stop_strings must be non-empty strings: {s!r}")
        if self.sliding_window is not None:
            need(
                is_int(self.sliding_window) and self.sliding_window >= 2,
                f"sliding_window must be None or an integer >= 2 (the model's context, e.g. "
                f"its block_size), got {self.sliding_window!r}",
            )
            need(
                is_int(self.window_stride) and 1 <= self.window_stride < self.sliding_window,
                f"window_stride must be an integer in [1, sliding_window - 1 = "
                f"{self.sliding_window - 1}], got {self.window_stride!r}",
            )
            need(
                strategy in ("greedy", "sample"),
                f"sliding_window works with greedy decoding and sampling, not "
                f"strategy={strategy!r}",
            )
        need(
            is_int(self.num_assistant_tokens) and self.num_assistant_tokens >= 1,
            f"num_assistant_tokens must be an integer >= 1, got {self.num_assistant_tokens!r}",
        )
