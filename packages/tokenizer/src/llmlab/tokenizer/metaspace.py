"""SentencePiece's text normalisation, shared by the Unigram model and its trainer.

NFKC (optional), runs of spaces collapsed and the ends stripped, then every space becomes ``▁``
and a ``▁`` is prepended, so word boundaries are ordinary characters a piece can contain.
"""

from __future__ import annotations

import unicodedata

SPACE = "▁"
NORMALIZATIONS = ("identity", "nfkc")


def normalize(
    text: str,
    normalization: str = "nfkc",
    remove_extra_whitespaces: bool = True,
    add_dummy_prefix: bool = True,
) -> str:
    """One line of text as the Unigram model sees it (``""`` for a blank line)."""
    if normalization == "nfkc":
        text = unicodedata.normalize("NFKC", text)
    if remove_extra_whitespaces:
        text = " ".join(w for w in text.split(" ") if w)
    if not text:
        return ""
    text = text.replace(" ", SPACE)
    if add_dummy_prefix:
        text = SPACE + text
    return text
