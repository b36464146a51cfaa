"""Errors with the file and the problem in the message."""

from __future__ import annotations

from pathlib import Path


class TokenizerFileError(ValueError):
    """A tokenizer file is damaged or in a format llmlab cannot read."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnknownTokenError(ValueError, KeyError):
    """An id (or token) that is not in the vocabulary. A ``ValueError`` whose message names
    the value and the valid range; also a ``KeyError``, which is what tiktoken raises, so code
    written for tiktoken's ``except KeyError`` keeps working."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
