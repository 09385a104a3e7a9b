"""Loader workers under ``torch.distributed``: a start method that inherits no lock, a bounded wait, named errors.

Three things keep a stuck worker from hanging a multi-rank job:

- **Start method.** A rank runs gloo's or NCCL's threads, the TCPStore server and the previous iterator's queue
  feeders; ``fork`` copies their locks held mid-operation into the worker, which can then block at start-up. With
  ``torch.distributed`` initialised and workers asked for, :func:`worker_options` starts them with ``forkserver``
  (a clean server process, torch and lit_seqpack preloaded, so a worker starts in a fraction of a second) when the
  dataset, collator and worker init function pickle; otherwise with ``fork``, logged.
- **A finite wait.** Every loader gets ``timeout=loader_timeout``: torch then waits that long for a worker's
  start-up acknowledgement or its next batch, and raises instead of waiting forever.
  :func:`named_timeout` turns torch's bare "DataLoader timed out" into an error naming the loader and the rank.
- **Every rank learns.** The first batch of an iteration is where a worker stuck at start-up shows. After it,
  :func:`agree_started` has every rank post whether its workers started to the process group's store and wait
  (bounded) for the others' posts: a rank whose workers started raises too, naming the rank that is stuck, instead
  of entering its first collective with a rank that never comes.

Cross-rank checks that need a collective (the plan check of the indexed pipeline) run in the main process before
the loader's workers start, never behind a wait for them.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_LOADER_TIMEOUT", "agree_started", "named_timeout", "rank_name", "worker_options"]

log = logging.getLogger(__name__)

DEFAULT_LOADER_TIMEOUT = 600.0
"""Seconds a loader waits for a worker's start-up or its next batch before it raises (``loader_timeout``)."""
_PRELOAD = ["torch", "lit_seqpack.data.datamodule"]
_STORE_PREFIX = "lit_seqpack/workers"
_iterations: dict[str, itertools.count] = {}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_name() -> str:
    """``"rank r of w"`` under ``torch.distributed``, else ``"the only rank"`` (for messages)."""
    return f"rank {dist.get_rank()} of {dist.get_world_size()}" if _distributed() else "the only rank"


def worker_options(
    num_workers: int, timeout: float, *picklable: Any, start_method: str | None = None
) -> dict[str, Any]:
    """The ``DataLoader`` keywords for ``num_workers`` workers: ``timeout`` and, under ``torch.distributed``, the
    start method (see the module docstring).

    Args:
        num_workers: the loader's worker processes (0: no keyword is needed).
        timeout: seconds to wait for a worker (``loader_timeout``), > 0.
        *picklable: what a worker receives (dataset, collator, worker init function): ``forkserver`` only if they
            pickle.
        start_method: force a start method (``None``: ``forkserver`` under ``torch.distributed`` where possible).

    Example:
        >>> worker_options(0, 60.0)
        {}
        >>> worker_options(2, 60.0)
        {'timeout': 60.0}
    """
    if not num_workers:
        return {}
    options: dict[str, Any] = {"timeout": float(timeout)}
    if start_method is None and _distributed() and "forkserver" in multiprocessing.get_all_start_methods():
        try:
            pickle.dumps(picklable)
        except Exception as err:  # noqa: BLE001 - any pickling failure means: keep fork
            log.warning(
                "lit_seqpack: the loader's dataset or collator does not pickle (%s: %.200s), so its workers fork from "
                "a process that runs torch.distributed's threads; make it picklable to start them with forkserver",
                type(err).__name__,
                err,
            )
        else:
            start_method = "forkserver"
    if start_method is not None:
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload(_PRELOAD)  # used when the server starts (once a process)
        options["multiprocessing_context"] = context
    return options


def named_timeout(err: BaseException, loader: str, timeout: float) -> RuntimeError | None:
    """torch's "DataLoader timed out" as an error naming ``loader`` and this rank, or ``None`` for other errors."""
    if not isinstance(err, RuntimeError) or "DataLoader timed out" not in str(err):
        return None
    return RuntimeError(
        f"the {loader} loader on {rank_name()} got nothing from its worker processes within loader_timeout="
        f"{timeout:g} s (a worker stuck at start-up, in a worker_init_fn or reading a sample): raise loader_timeout "
        "if reading one microbatch really takes that long"
    )


def agree_started(loader: str, timeout: float, error: str | None = None) -> None:
    """Post whether this rank's ``loader`` workers started, wait (at most ``timeout`` + 10 s) for every rank's post,
    and raise if some rank's did not start (see the module docstring); nothing without ``torch.distributed``.

    Every rank calls it once per iteration of ``loader`` (a counter per loader name keys the posts).

    Args:
        loader: the loader's name (``"train"``, ``"val"``, ...), the same on every rank.
        timeout: the loader's ``loader_timeout``.
        error: this rank's own start-up error, posted for the others (``None``: started).

    Raises:
        RuntimeError: another rank posted an error or posted nothing in time, naming it.
    """
    store = _store()
    if store is None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    iteration = next(_iterations.setdefault(loader, itertools.count()))
    prefix = f"{_STORE_PREFIX}/{loader}/{iteration}"
    store.set(f"{prefix}/{rank}", "" if error is None else error)
    if error is not None:
        return
    others = [r for r in range(world) if r != rank]
    try:
        store.wait([f"{prefix}/{r}" for r in others], timedelta(seconds=timeout + 10))
    except Exception as err:  # noqa: BLE001 - a store timeout or a vanished peer: either way that rank did not post
        missing = [r for r in others if not _has(store, f"{prefix}/{r}")]
        raise RuntimeError(
            f"the {loader} loader on {rank_name()}: rank(s) {missing or others} did not report that their loader "
            f"workers started within loader_timeout={timeout:g} s + 10 s ({type(err).__name__}); they are stuck or "
            "gone, so this rank stops instead of waiting for them in a collective"
        ) from err
    failed = {r: store.get(f"{prefix}/{r}").decode() for r in others}
    failed = {r: text for r, text in failed.items() if text}
    if failed:
        named = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
        raise RuntimeError(f"the {loader} loader on {rank_name()} stops because another rank's workers failed: {named}")


def _store() -> Any:
    if not _distributed() or dist.get_world_size() == 1:
        return None
    get_store: Callable[[], Any] | None = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return None if get_store is None else get_store()
    except (RuntimeError, ValueError):  # a process group without a store (e.g. a fake backend)
        return None


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - the store itself is gone
        return False
