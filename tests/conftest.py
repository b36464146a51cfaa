"""Suite-wide settings: no network, W&B off unless a test is about logging, CUDA tests skipped."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: CI is reproducible, and a failing input
# found locally (`--hypothesis-seed=random` explores) is kept as an explicit example.
settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.load_profile("deterministic")

# Unit tests never talk to a hub or to W&B's servers; logging tests opt back into offline mode.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
