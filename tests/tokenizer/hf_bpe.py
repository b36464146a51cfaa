"""HF ``tokenizers`` ByteLevel BPE set up the way llmlab's training is specified."""

from __future__ import annotations

from pathlib import Path

from llmlab.tokenizer.patterns import resolve_pattern, to_onig


def hf_bpe_trained(files: list[Path], vocab_size: int, pattern: str, specials: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pattern == "hf-bytelevel":  # HF's classic ByteLevel(use_regex=True)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(to_onig(resolve_pattern(pattern))), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def hf_merges(tok) -> list[tuple[str, str]]:
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
