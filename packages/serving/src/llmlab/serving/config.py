"""``EngineConfig``: the sizes that shape the engine, checked together before anything is built.

Every limit here exists because a part of the engine relies on it: the scheduler reserves one
token of the step's budget for each running sequence (so ``max_num_batched_tokens`` must cover
``max_num_seqs``), and preemption can always make room for the oldest sequence only if the pool
holds one sequence of ``max_model_len`` tokens. ``validate()`` names the numbers that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass
class EngineConfig:
    """How big the KV pool is and how much work one step may do.

    ``num_blocks`` x ``block_size`` token slots make the KV pool (``kv_cache_tokens`` picks
    ``num_blocks`` from a token count instead); ``max_num_seqs`` caps the running sequences and
    ``max_num_batched_tokens`` the tokens of one forward (prefill chunks plus one per decoding
    sequence). ``max_model_len`` (default: the model's context) caps prompt plus output.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_tokens: int | None = None  # alternative to num_blocks: blocks = ceil(tokens / size)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"  # "auto": Triton on CUDA, the torch reference on CPU
    # weight-only quantization of the model's linear layers at load ("bf16", "int8", "int4",
    # "int4:g64", see llmlab.models.quantize): fewer bytes read per token. The model given to
    # the engine is converted in place (its full-precision weights are released: no second copy)
    quantize: str | None = None
    # the KV pool's dtype: "auto" is the model's; "bfloat16" halves an fp32 model's KV bytes
    # (keys and values rounded when written, attention computed in that dtype)
    kv_cache_dtype: str = "auto"
    # decode-only steps through torch.compile at batch sizes 1, 2, 4, 8, 16 (padded up; one
    # graph each, compiled when first needed: seconds on a CPU), llmlab.serving.compiled_decode
    compile: bool = False
    # fault injection for the isolation tests ("stage:marker", llmlab.serving.faults); None
    # reads LLMLAB_SERVING_INJECT_FAULT, which is normally unset: no fault
    inject_fault: str | None = None
    # speculative decoding (llmlab.serving.speculation): "ngram" (prompt lookup: the tokens
    # that followed the sequence's last n-gram the last time it occurred) or "draft" (a small
    # model given to LLMEngine as draft_model); num_speculative_tokens drafts per step are
    # verified in one forward of the target. None: one token per sequence per step
    speculative: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1  # the shortest suffix n-gram prompt lookup matches
    ngram_max: int = 4  # the longest (tried first)
    draft_quantize: str | None = None  # the draft model's weight scheme (as ``quantize``)

    def resolved(self, model_context: int) -> EngineConfig:
        """A copy with ``max_model_len`` and ``num_blocks`` filled in, validated.

        Defaults: ``max_model_len`` is the model's context; the pool holds
        ``max_num_seqs`` sequences of ``max_model_len`` tokens if neither size is given.
        """
        max_len = self.max_model_len if self.max_model_len is not None else model_context
        if isinstance(max_len, int) and max_len > model_context:
            raise ValueError(
                f"EngineConfig: max_model_len={max_len} exceeds the model's context of "
                f"{model_context} tokens"
            )
        blocks = self.num_blocks
        if blocks is not None and self.kv_cache_tokens is not None:
            raise ValueError(
                f"EngineConfig: give num_blocks ({blocks}) or kv_cache_tokens "
                f"({self.kv_cache_tokens}), not both"
            )
        if blocks is None:
            tokens = self.kv_cache_tokens
            if tokens is None:
                tokens = self.max_num_seqs * max_len
            blocks = -(-tokens // self.block_size) if isinstance(tokens, int) else tokens
        out = EngineConfig(**{**self.__dict__, "num_blocks": blocks, "max_model_len": max_len})
        out.kv_cache_tokens = None
        out.validate()
        return out

    def validate(self) -> None:
        """Fail early, naming the bad value and what would be valid."""

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {message}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be a positive integer, got {value!r}",
            )

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive(name)
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            positive(name)
        need(
            self.speculative is None or self.speculative in SPECULATIVE_METHODS,
            f"speculative={self.speculative!r}; valid: None or one of {list(SPECULATIVE_METHODS)}",
        )
        need(
            self.ngram_min <= self.ngram_max,
            f"ngram_min={self.ngram_min} must be <= ngram_max={self.ngram_max}",
        )
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("quantize", "draft_quantize"):
            if getattr(self, name) is not None:
                from llmlab.models.quantize import parse_scheme

                try:
                    parse_scheme(getattr(self, name))
                except ValueError as err:  # the message names ``quantize=``: say which
                    need(False, str(err).replace("quantize=", f"{name}=", 1))
        need(
            self.draft_quantize is None or self.speculative == "draft",
            f"draft_quantize={self.draft_quantize!r} needs speculative='draft' (there is no "
            f"draft model to quantize with speculative={self.speculative!r})",
        )
        if self.inject_fault is not None:
            from llmlab.serving.faults import FaultInjection

            try:
                FaultInjection.parse(self.inject_fault)
            except ValueError as err:
                need(False, str(err))
        need(
            isinstance(self.compile, bool),
            f"compile={self.compile!r}; valid: True or False",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype={self.kv_cache_dtype!r}; valid: {list(KV_CACHE_DTYPES)}",
        )
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend={self.attention_backend!r}; valid: {list(ATTENTION_BACKENDS)}",
        )
        need(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
            f"{self.max_num_seqs}: every running sequence needs one token of each step",
        )
        if self.max_model_len is not None and not self.enable_chunked_prefill:
            need(
                self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill a prompt is computed in one step, so "
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} (or enable_chunked_prefill=True)",
            )
        if self.max_model_len is not None and self.num_blocks is not None:
            per_sequence = -(-self.max_model_len // self.block_size)
            need(
                self.num_blocks >= per_sequence,
                f"num_blocks={self.num_blocks} of {self.block_size} tokens cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens ({per_sequence} blocks)",
            )
