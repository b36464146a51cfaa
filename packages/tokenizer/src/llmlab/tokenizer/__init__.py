"""llmlab.tokenizer: byte-level BPE, WordPiece and Unigram tokenizers (no torch).

Each matches a reference id for id: HF ``tokenizers`` and tiktoken for BPE, HF's BERT WordPiece,
and sentencepiece for Unigram. ``load(path)`` reads llmlab's own JSON, HF ``tokenizer.json``,
``.tiktoken`` ranks and GPT-2's ``encoder.json`` + ``vocab.bpe``; ``save(tok, path, format)``
writes the first three. ``ByteTokenizer`` is the 256 byte values as tokens.
"""

from llmlab.tokenizer.bpe import BPETokenizer
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.formats import load, save
from llmlab.tokenizer.raw_bytes import ByteTokenizer
from llmlab.tokenizer.unigram import UnigramTokenizer
from llmlab.tokenizer.wordpiece import WordPieceTokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "TokenizerFileError",
    "UnigramTokenizer",
    "WordPieceTokenizer",
    "load",
    "save",
]
