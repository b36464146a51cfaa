"""Distributed tests run through the package's launcher, with its ranks forked from a server.

Started by ``spawn``, each rank of each test imported torch and Lightning again: about 7 CPU
seconds per rank, some hundreds of ranks per suite, on two cores. Here the ranks are forked from
a forkserver that imported those modules once per test worker (``run_distributed``'s
``start_method="forkserver"``; each rank still gets the caller's environment at the call).

One exception keeps the spawn behaviour: Triton decides at import whether it interprets its
kernels, and the server imported it (through Lightning) with the environment it started with. A
call made with another ``TRITON_INTERPRET`` than that starts its ranks with ``spawn``, so that they
import Triton afresh under the caller's setting.
"""

from __future__ import annotations

import os
from typing import Any

from llmlab.parallel.launch import free_port
from llmlab.parallel.launch import run_distributed as _launch

__all__ = ["free_port", "run_distributed"]

PRELOAD = ("torch", "lightning", "llmlab.models", "llmlab.parallel", "llmlab.train")
IMPORT_TIME_VARIABLES = ("TRITON_INTERPRET",)  # read once, when the module is imported

_server_environment: dict[str, str | None] | None = None  # the forkserver's, once started


def run_distributed(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``llmlab.parallel.launch.run_distributed``, forking the ranks from a preloaded server
    unless the call's import-time environment differs from the server's (see the module doc)."""
    global _server_environment
    now = {name: os.environ.get(name) for name in IMPORT_TIME_VARIABLES}
    if _server_environment is None:
        _server_environment = now
    if now != _server_environment:
        return _launch(fn, world_size, *args, **kwargs)
    return _launch(fn, world_size, *args, start_method="forkserver", preload=PRELOAD, **kwargs)
