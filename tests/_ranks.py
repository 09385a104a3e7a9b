"""Start-up of the suite's multi-process tests: a free port, and a spawned process made one rank of a gloo group.

``torch.multiprocessing.spawn`` starts each rank with the ``spawn`` start method, and the spawned process keeps it as
its default: each DataLoader worker of each epoch then starts a fresh interpreter that imports torch, Lightning and
the test module again (3-5 s a worker on a 2-core box, most of what the streaming DDP tests took). :func:`join_ranks`
makes the rank's workers fork instead, as they do under ``torchrun`` and Lightning's own DDP launcher on Linux. That
a stream's dataset survives the pickling of a ``spawn`` worker is checked on its own, once, in
``tests/data/streaming/test_dataset.py``.

:func:`spawn_ranks` starts a test's ranks with a deadline below the test's own limit: when it passes, every process
of the group (ranks and their loader workers, whatever their start method) writes the Python stacks of all its
threads to stderr (``PYTHONFAULTHANDLER`` is set for every descendant, then each gets ``SIGABRT``), so a hang shows
where each process waits. Every rank destroys its process group before it exits (:func:`end_ranks`, also registered
by :func:`join_ranks` for a group Lightning creates): a process that ran gloo and exits with the group alive can die
with ``SIGABRT`` ("terminate called without an active exception") and fail the test by chance.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._limits import SUBPROCESS_TIMEOUT_S


def free_port() -> int:
    """A free TCP port on localhost (for a process group's ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_ranks(rank: int, world_size: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of ``world_size`` for Lightning (which then starts no process) on
    ``127.0.0.1:port``, with one torch thread and DataLoader workers that fork (see the module docstring).

    Args:
        rank: this process's global (and local) rank.
        world_size: the number of processes.
        port: the process group's ``MASTER_PORT`` (:func:`free_port` in the parent).
    """
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)})
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    multiprocessing.util.Finalize(None, end_ranks, exitpriority=100)  # run at a spawned process's exit


def end_ranks() -> None:
    """Destroy this process's default process group, if it has one (call before a spawned rank exits)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _rank_main(rank: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(rank, *args)
    finally:
        end_ranks()


def spawn_ranks(
    fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, timeout_s: float = SUBPROCESS_TIMEOUT_S
) -> None:
    """``mp.spawn(fn, args, nprocs)`` with a deadline: past ``timeout_s`` every process of the group (workers
    included) dumps its stacks to stderr and is ended, and ``TimeoutError`` is raised; each rank ends its process
    group before it exits.

    Raises:
        TimeoutError: the ranks did not finish within ``timeout_s`` (their stacks are on stderr).
        torch.multiprocessing.ProcessRaisedException: a rank raised (the others are ended).
    """
    os.environ["PYTHONFAULTHANDLER"] = "1"  # inherited by every descendant: SIGABRT dumps its stacks
    context = mp.start_processes(_rank_main, args=(fn, args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            dumped = dump_stacks(context.pids())
            raise TimeoutError(
                f"{nprocs} ranks of {getattr(fn, '__name__', fn)} ran past {timeout_s:g} s: the Python stacks of "
                f"{dumped} processes (ranks and loader workers) are on stderr"
            )


def dump_stacks(pids: list[int]) -> int:
    """Make ``pids`` and all their descendants write their Python stacks to stderr and end (``SIGABRT`` under
    ``PYTHONFAULTHANDLER``), the deepest first; returns how many were signalled."""
    processes: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            processes += [*reversed(parent.children(recursive=True)), parent]
    signalled = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGABRT)
            signalled += 1
            time.sleep(0.2)  # one process's dump at a time on the shared stderr
    sys.stderr.flush()
    time.sleep(1.0)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return signalled
