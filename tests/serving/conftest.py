"""One intra-op thread for the serving tests: the models are tiny, and on a shared 2-core
machine extra torch threads spin-wait for each other (see tests/decoding/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
