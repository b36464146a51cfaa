"""``run_distributed``'s launcher: results in rank order, failures with their traceback, a
rendezvous port that cannot be taken by another process's outgoing connection, and ranks forked
from a preloaded server that still get the caller's environment."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from llmlab.parallel.launch import free_port, run_distributed
from tests.helpers.distributed import PRELOAD


def _rank_and_size(rank: int, world_size: int, offset: int) -> tuple[int, int]:
    return rank + offset, world_size


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    assert rank != 1, "rank one refuses"


def _environment(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_and_size, 2, 10) == [(10, 2), (11, 2)]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed:.*rank one refuses"):
        run_distributed(_fails_on_rank_one, 2)


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not range_file.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
    ephemeral_start = int(range_file.read_text().split()[0])
    if ephemeral_start < 21000:
        pytest.skip(f"ephemeral range starts at {ephemeral_start}: no room below it")
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random: parallel callers do not collide by construction
    for port in ports:
        assert port < ephemeral_start  # bind(0) and outgoing connections never hand it out
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_forkserver_ranks_get_the_callers_environment_at_each_call(monkeypatch):
    """The server starts at the first call with one environment; a variable set afterwards
    still reaches the ranks of the next call (it replaces the server's), as under spawn. (The
    tests' own preload: should this call start the test worker's server, the distributed tests
    after it still find torch and Lightning imported there.)"""
    name = "LLMLAB_TEST_LAUNCH_VARIABLE"
    monkeypatch.setenv(name, "first")
    first = run_distributed(_environment, 2, name, start_method="forkserver", preload=PRELOAD)
    assert first == ["first", "first"]
    monkeypatch.setenv(name, "second")
    assert run_distributed(_environment, 2, name, start_method="forkserver") == ["second"] * 2
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed:.*rank one refuses"):
        run_distributed(_fails_on_rank_one, 2, start_method="forkserver")


def test_an_unknown_start_method_or_a_preload_without_a_server_is_refused():
    with pytest.raises(ValueError, match=r"start_method='fork' is not supported.*'forkserver'"):
        run_distributed(_rank_and_size, 2, 0, start_method="fork")
    with pytest.raises(ValueError, match=r"preload=\['torch'\] needs start_method='forkserver'"):
        run_distributed(_rank_and_size, 2, 0, preload=["torch"])
