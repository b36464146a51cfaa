"""One intra-op thread for the decoding tests.

The models here are tiny, so every op is a few microseconds of work; with several torch threads
on a shared 2-core machine the threads spin-wait for each other and a 9-token generate took
~1 s of CPU instead of ~0.02 s (measured). One thread is also what makes runs reproducible.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
