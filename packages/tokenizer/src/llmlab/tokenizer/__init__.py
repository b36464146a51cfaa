"""llmlab.tokenizer: the tokenizer families LLMs use, each matching its reference id for id (no
torch).

- ``BPETokenizer``: byte-level BPE (GPT-2, GPT-4, Llama 3, Qwen) — HF ``tokenizers``, tiktoken;
- ``WordBPETokenizer``: end-of-word BPE (Sennrich; GPT-1, CLIP, XLM) — HF ``tokenizers``;
- ``SentencePieceBPETokenizer``: SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma) —
  sentencepiece and HF ``tokenizers``;
- ``WordPieceTokenizer`` (BERT) — HF ``tokenizers``; ``UnigramTokenizer`` — sentencepiece.

``load(path)`` reads every supported file (llmlab's JSON, HF ``tokenizer.json``, SentencePiece
``.model``, ``.tiktoken``, ``vocab.json`` + ``merges.txt``); ``tok.save(path, format)`` writes them.
``ByteTokenizer`` is the 256 byte values as tokens.
"""

from llmlab.tokenizer.base import TokenizerBase
from llmlab.tokenizer.bpe import BPETokenizer
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.formats import load, save
from llmlab.tokenizer.raw_bytes import ByteTokenizer
from llmlab.tokenizer.sp_bpe import SentencePieceBPETokenizer
from llmlab.tokenizer.unigram import UnigramTokenizer
from llmlab.tokenizer.word_bpe import WordBPETokenizer
from llmlab.tokenizer.wordpiece import WordPieceTokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "SentencePieceBPETokenizer",
    "TokenizerBase",
    "TokenizerFileError",
    "UnigramTokenizer",
    "WordBPETokenizer",
    "WordPieceTokenizer",
    "load",
    "save",
]
