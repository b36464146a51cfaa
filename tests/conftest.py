"""Suite-wide settings: no network, W&B off unless a test is about logging, CUDA tests skipped."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.helpers.runs import LAUNCH_VARIABLES

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


@pytest.fixture(autouse=True)
def _no_launch_state_leaks_between_tests():
    """Each test starts with the launch variables (and process group) the worker had.

    Lightning writes them (and starts a process group it never destroys) in the process that
    fits with a distributed strategy, even on one device: a test training in the pytest worker
    (test_export's NDParallelStrategy fit) handed LOCAL_RANK and MASTER_PORT to every later test
    there and to the training subprocesses they start (see ``tests.helpers.runs``).
    """
    before = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
