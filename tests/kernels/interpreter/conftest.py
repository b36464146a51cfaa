"""Runs only with ``TRITON_INTERPRET=1`` set before triton was imported (see ../conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreter_is_live():
    import triton.language.standard as standard

    assert type(standard.zeros).__name__ == "InterpretedFunction", (
        "triton was imported before TRITON_INTERPRET=1 was set"
    )
    torch.manual_seed(0)
