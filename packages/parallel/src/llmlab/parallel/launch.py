"""Run a plain function on N gloo ranks on localhost and collect each rank's result.

A process launcher for the places where ``torchrun`` is too heavy: tests, benchmarks and
notebooks that want to run ``fn(rank, world_size, *args)`` on every rank of a small CPU group and
get the return values back. ``run_distributed`` starts the ranks (one free localhost port below
the ephemeral range, ``torch.distributed`` initialised with gloo), waits for them, and returns
their results in rank order -- or raises with the traceback of the first rank that failed,
instead of a hang or a bare exit code. Multi-node training is Lightning's (``torchrun``/SLURM),
not this.

Start methods: ``spawn`` (the default) starts every rank as a fresh interpreter, which then
imports what ``fn`` needs -- about 7 CPU seconds per rank once Lightning is among it. A caller
that launches many small runs (a test suite) can pass ``start_method="forkserver"`` with the
heavy modules in ``preload``: they are imported once, in a server process, and every rank is a
fork of it (a launch then costs a fraction of a second). Each rank still gets the caller's
environment as it is at the call (it replaces the server's before ``fn`` runs), so a variable
set before the call reaches the rank as under ``spawn``. What differs: a module that reads the
environment when it is imported -- a preloaded one, or ``fn``'s own module, imported as the rank
starts -- sees the server's environment (Triton decides at import whether to interpret its
kernels, so a ``TRITON_INTERPRET`` set after the server started needs ``spawn``); and the
ranks' output goes to the server's stdout/stderr, not the caller's at the time of the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, chosen below the kernel's ephemeral range.

    Why not ``bind(0)``: the OS hands those ports out of the ephemeral range, the same pool
    every outgoing connection takes its source port from. Between choosing the port and the
    rendezvous binding it, a gloo connection of any other process group on the machine (a
    parallel test worker, another run) can take it, and ``init_process_group`` fails with
    EADDRINUSE. A random port under that range is only ever held by someone who asked for it.
    """
    pick = random.SystemRandom()  # not the seeded module RNG: parallel callers must differ
    below = _ephemeral_range_start()
    for _ in range(200 if below > _LOWEST_PORT + 1000 else 0):
        port = pick.randrange(_LOWEST_PORT, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded machine
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LOWEST_PORT = 20000  # above the registered services commonly found on developer machines


def _ephemeral_range_start() -> int:
    """First port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: mp.Queue,
    threads: int,
    backend: str,
    environ: dict[str, str] | None,
) -> None:
    if environ is not None:  # a forkserver child: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # Several ranks share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":  # one GPU per rank, as NCCL requires
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Plain pickle (not torch's shared-memory reduction): a tensor result must outlive the
        # rank that made it.
        out = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    backend: str = "gloo",
    start_method: str = "spawn",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); so must the results
    (CPU tensors are fine: they are copied by value). ``backend="nccl"`` puts rank r on GPU r
    (GPU tests); the default is gloo on the CPU. ``start_method="forkserver"`` forks the ranks
    from a server that imported ``preload`` once (see the module doc); ``preload`` is read when
    that server starts, at the first such call of this process.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; valid: 'gloo', 'nccl'")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"start_method={start_method!r} is not supported; valid: 'spawn', 'forkserver'"
        )
    if preload and start_method != "forkserver":
        raise ValueError(f"preload={list(preload)} needs start_method='forkserver'")
    ctx = mp.get_context(start_method)
    environ = None
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
        environ = dict(os.environ)
    results: mp.Queue = ctx.Queue()
    port = free_port()
    worker_args = (world_size, port, args, results, threads, backend, environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, *worker_args)) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                raise TimeoutError(
                    f"distributed run timed out after {timeout}s; ranks without a result: "
                    f"{sorted(set(range(world_size)) - set(collected))} (exited early: {dead})"
                ) from None
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [collected[r] for r in range(world_size)]
