"""The packed rows and tiny models the document-masking tests share (CPU, fp32).

Row 0 packs three documents (5, 11 and 8 tokens); row 1 is one document. ``check`` asserts
the two properties Done-when 3 names for one model with one attention path: a token's logits
do not move when the *other* documents of its row change, and they equal the logits of its
document run alone (positions from 0) within ``TOL``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GPT_CFG = dict(arch="gpt", vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA_CFG = dict(
    arch="llama", vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=48,
)  # fmt: skip
MODELS = {"gpt": GPT_CFG, "llama": LLAMA_CFG}
TOL = dict(atol=1e-5, rtol=0)  # fp32: the same sums over fewer (masked) keys
SPANS = [(0, 0, 5), (0, 5, 16), (0, 16, 24), (1, 0, 24)]  # (row, start, end) of each document
T = 24


def packed_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, T), generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [4] * T])
    return ids, docs


def with_other_documents_changed(ids: torch.Tensor, row: int, start: int, end: int):
    """``ids`` with every token of ``row`` outside ``[start, end)`` redrawn."""
    g = torch.Generator().manual_seed(99 + start)
    other = ids.clone()
    noise = torch.randint(0, 64, ids[row].shape, generator=g)
    keep = torch.zeros(T, dtype=torch.bool)
    keep[start:end] = True
    other[row] = torch.where(keep, ids[row], noise)
    return other


def check(logits_of: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> None:
    """``logits_of(ids, document_ids)`` -> full (B, T, V) logits of one model and path."""
    ids, docs = packed_rows()
    with torch.no_grad():
        packed = logits_of(ids, docs)
        for row, start, end in SPANS:
            alone = logits_of(ids[row : row + 1, start:end], None)[0]
            torch.testing.assert_close(packed[row, start:end], alone, **TOL)
            if end - start < T:
                moved = logits_of(with_other_documents_changed(ids, row, start, end), docs)
                torch.testing.assert_close(moved[row, start:end], packed[row, start:end], **TOL)
        # the control: without document ids the middle document does see its neighbours
        plain = logits_of(ids, None)
        assert not torch.allclose(plain[0, 5:16], packed[0, 5:16], atol=1e-3)
