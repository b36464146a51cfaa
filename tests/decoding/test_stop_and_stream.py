"""Stop strings and streaming on real byte-level BPE output with multi-byte characters.

A HF ``tokenizers`` ByteLevel BPE (the oracle tokenizer) is trained in-test on a small text
with CJK and emoji, with so few merges that those characters span several tokens. A tiny GPT
is then trained for a few seconds to memorise a sentence, so greedy decoding really emits tokens
that split UTF-8 characters. The streamed pieces must join to exactly the tokenizer's decoding
of the output, and never contain U+FFFD.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmlab.decoding import TextStreamer, generate
from llmlab.models import GPT, GPTConfig

SENTENCE = "Hi 你好世界! 🙂 naïve café — 東京 🚀 ok. 再见👋 end"
CORPUS = [
    "hello world, the cat sat on the mat.",
    "你好世界 东京 再见 朋友 天气很好",
    "emoji 🙂🚀👋 and accents: naïve café résumé",
] * 20


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-ins for bytes, inverted (what ByteLevel BPE stores)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class ByteLevelBytes:
    """Gives a HF ByteLevel tokenizer a ``decode_bytes``: token strings -> raw bytes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.table = _byte_decoder()

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(self.table[c] for i in ids for c in self.tok.id_to_token(i))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


@functools.cache
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@functools.cache
def memorised() -> tuple[GPT, list[int]]:
    """A tiny GPT that continues SENTENCE's first token with the rest of SENTENCE."""
    ids = tokenizer().encode(SENTENCE).ids
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=tokenizer().get_vocab_size(), block_size=64, n_layer=1, n_head=2, n_embd=48
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    x = torch.tensor([ids[:-1]])
    y = torch.tensor([ids[1:]])
    for step in range(400):
        logits = model(x)[0]
        if step % 10 == 0 and bool((logits.argmax(-1) == y[0]).all()):
            break  # greedy already reproduces the sentence
        loss = torch.nn.functional.cross_entropy(logits, y[0])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    out = generate(model, torch.tensor([ids[:1]]), max_new_tokens=len(ids) - 1)
    assert out[0].tolist() == ids, "the tiny GPT did not memorise the sentence"
    return model, ids


def test_the_fixture_really_splits_characters():
    tok = ByteLevelBytes(tokenizer())
    _, ids = memorised()
    broken = [i for i in ids if "\ufffd" in tokenizer().decode([i])]
    assert broken, "no token holds a partial UTF-8 character: the test would prove nothing"
    assert tok.decode_bytes(ids).decode("utf-8") == SENTENCE


@pytest.mark.parametrize("mode", ["bytes", "text"])
def test_streaming_yields_the_final_text_without_broken_characters(mode):
    model, ids = memorised()
    tok = ByteLevelBytes(tokenizer()) if mode == "bytes" else tokenizer()
    pieces: list[str] = []
    streamer = TextStreamer(tok, on_text=pieces.append)
    out = generate(model, torch.tensor([ids[:1]]), max_new_tokens=len(ids) - 1, streamer=streamer)
    final = tokenizer().decode(out[0, 1:].tolist())
    assert "".join(pieces) == final == SENTENCE[len(tokenizer().decode(ids[:1])) :]
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 5  # it streamed, it did not just print once at the end
    assert list(iter(streamer)) == pieces  # the iterator face yields the same pieces


def test_streaming_with_llmlab_bpe_tokenizer():
    bpe = pytest.importorskip("llmlab.tokenizer.bpe")
    tok = bpe.BPETokenizer.train(CORPUS, vocab_size=300, show_progress=False)
    ids = tok.encode(SENTENCE)
    streamer = TextStreamer(tok, skip_prompt=False)
    for i in ids:  # token by token, as generate does
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert streamer.text == SENTENCE
    assert all("\ufffd" not in p for p in streamer.pieces)


def _boundary_stop(tok: ByteLevelBytes, gen: list[int]) -> tuple[str, int]:
    """A stop string straddling a token boundary of ``gen``, and the index of the token that
    completes it."""
    for j in range(2, len(gen)):
        left, right = tok.decode_bytes([gen[j - 1]]), tok.decode_bytes([gen[j]])
        candidate = left[-2:] + right[:2]
        try:
            text = candidate.decode("utf-8")
        except UnicodeDecodeError:
            continue
        before = tok.decode_bytes(gen[:j])
        if len(left) >= 2 and len(right) >= 2 and candidate not in before:
            return text, j
    raise AssertionError("no ASCII-safe boundary found")


def test_stop_string_straddling_tokens_stops_on_the_completing_token():
    model, ids = memorised()
    tok = ByteLevelBytes(tokenizer())
    gen = ids[1:]
    stop, j = _boundary_stop(tok, gen)
    out = generate(
        model, torch.tensor([ids[:1]]), max_new_tokens=len(gen), stop_strings=[stop], tokenizer=tok
    )
    assert out[0, 1:].tolist() == gen[: j + 1]
    # a stop string in the middle of a multi-byte character sequence: "世界" spans tokens
    out = generate(
        model, torch.tensor([ids[:1]]), max_new_tokens=len(gen), stop_strings="世界", tokenizer=tok
    )
    text = tok.decode_bytes(out[0, 1:].tolist()).decode("utf-8", errors="replace")
    assert text.endswith("世界") or text.rstrip("\ufffd").endswith("世界")
    assert "!" not in text


def test_each_row_stops_on_its_own():
    """Batch of 2: one row hits a stop string early; the other continues; padding fills."""
    model, ids = memorised()
    tok = ByteLevelBytes(tokenizer())
    n = len(ids) - 1
    prompts = torch.tensor([ids[:2], ids[5:7]])
    out = generate(
        model, prompts, max_new_tokens=6, stop_strings=["🙂"], tokenizer=tok, pad_token_id=0
    )
    alone = [generate(model, prompts[b : b + 1], max_new_tokens=6) for b in range(2)]
    stopped_rows = [
        b
        for b in range(2)
        if "🙂" in tok.decode_bytes(alone[b][0, 2:].tolist()).decode("utf-8", "replace")
    ]
    assert n > 6
    for b in range(2):
        row = out[b, 2:].tolist()
        full = alone[b][0, 2:].tolist()
        if b in stopped_rows:
            k = next(
                i
                for i in range(1, 7)
                if "🙂" in tok.decode_bytes(full[:i]).decode("utf-8", "replace")
            )
            assert row[:k] == full[:k] and all(t == 0 for t in row[k:])
        else:
            assert row == full[: len(row)]
