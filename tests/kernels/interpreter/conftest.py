"""Runs only with ``TRITON_INTERPRET=1`` set before triton was imported (see ../conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreter_is_live():
    import triton.language.standard as standard

    assert type(standard.zeros).__name__ == "InterpretedFunction", (
        "these tests need TRITON_INTERPRET=1 in the environment before triton is imported: "
        "TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreter"
    )
    torch.manual_seed(0)
