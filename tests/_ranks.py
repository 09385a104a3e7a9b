"""Start-up of the suite's multi-process tests: a free port, and a spawned process made one rank of a gloo group.

``torch.multiprocessing.spawn`` starts each rank with the ``spawn`` start method, and the spawned process keeps it as
its default: each DataLoader worker of each epoch then starts a fresh interpreter that imports torch, Lightning and
the test module again (3-5 s a worker on a 2-core box, most of what the streaming DDP tests took). :func:`join_ranks`
makes the rank's workers fork instead, as they do under ``torchrun`` and Lightning's own DDP launcher on Linux. That
a stream's dataset survives the pickling of a ``spawn`` worker is checked on its own, once, in
``tests/data/streaming/test_dataset.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import torch


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
