"""Errors with the file and the problem in the message."""

from __future__ import annotations

from pathlib import Path


class TokenizerFileError(ValueError):
    """A tokenizer file is damaged or in a format llmlab cannot read."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
