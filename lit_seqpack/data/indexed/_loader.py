"""The DataModule's loader: a ``StatefulDataLoader`` whose resume point is its batch sampler's position.

Two ways a resumed run could train the wrong microbatches without an error, and what this module does:

- **The checkpoint arrives after the first** ``iter()``. FSDP, ModelParallel and DeepSpeed restore the
  checkpoint after the train loader is built, and a schedule reading ``trainer.estimated_stepping_batches``
  makes Lightning call ``iter()`` on it before that. Workers would already be fetching the epoch's first
  microbatches. :meth:`ResumableDataLoader.__iter__` therefore returns an iterator that builds the real one at
  its first ``next()``, so a state loaded in between is used; a state loaded after batches were drawn makes the
  stale iterator raise.
- **A cross-rank check behind a wait for workers.** The batch sampler's plan check is a collective; run at the
  sampler's first ``next()`` it would sit behind torch's wait for every worker's start-up, so a worker stuck on one
  rank would park the other inside the collective. The deferred iterator runs ``batch_sampler.check_plan()`` in the
  main process before it starts the workers, and every rank agrees that its workers started
  (:func:`~lit_seqpack.data.workers.agree_started`) before the first batch is returned.
- **The worker count changed** (``num_workers`` 0 -> 2, 2 -> 1, ...). torchdata's worker snapshot then
  cannot be restored (``AssertionError: State doesn't contain key '_snapshot'``). The batch sampler's position
  is the truth, so :meth:`ResumableDataLoader.load_state_dict` restores only the sampler and lets the workers
  start fresh.

torchdata's state layout (read by :func:`sampler_state_of`)::

    num_workers == 0   {"_index_sampler_state": <sampler state>, "_num_yielded": n, ...}
    num_workers  > 0   {"_snapshot": {"_main_snapshot": {"_num_workers": w,
                                                         "_index_sampler_state": <sampler state>, ...},
                                      ...},
                        "_steps_since_snapshot": 0, ...}
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from lit_seqpack.data.workers import DEFAULT_LOADER_TIMEOUT, agree_started, named_timeout, worker_options

__all__ = ["ResumableDataLoader", "loader_workers", "sampler_state_of"]

log = logging.getLogger(__name__)

_SNAPSHOT, _MAIN, _SAMPLER, _WORKERS = "_snapshot", "_main_snapshot", "_index_sampler_state", "_num_workers"


def loader_workers(state: Mapping[str, Any]) -> int:
    """The worker count of the ``StatefulDataLoader`` that wrote ``state``.

    Raises:
        ValueError: ``state`` is not a ``StatefulDataLoader`` state.

    Example:
        >>> loader_workers({"_index_sampler_state": {}, "_num_yielded": 3})
        0
        >>> loader_workers({"_snapshot": {"_main_snapshot": {"_num_workers": 2}}})
        2
    """
    if _SNAPSHOT in state:
        try:
            return int(state[_SNAPSHOT][_MAIN][_WORKERS])
        except (KeyError, TypeError, ValueError):
            pass
    elif _SAMPLER in state:
        return 0
    raise ValueError(f"not a StatefulDataLoader state (keys {sorted(state)}): cannot find the sampler's position")


def sampler_state_of(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The batch sampler's state inside a ``StatefulDataLoader`` state: the microbatches the loop consumed.

    Raises:
        ValueError: the state holds no sampler state, or one older than the batches the loop consumed.

    Example:
        >>> main = {"_num_workers": 2, "_index_sampler_state": {"epoch": 0, "position": 4}}
        >>> sampler_state_of({"_snapshot": {"_main_snapshot": main}, "_steps_since_snapshot": 0})
        {'epoch': 0, 'position': 4}
    """
    if loader_workers(state):
        if state.get("_steps_since_snapshot", 0):
            raise ValueError(
                f"the loader state is {state['_steps_since_snapshot']} batches past its last snapshot: the sampler's "
                "position cannot be read from it (use snapshot_every_n_steps=1, the default)"
            )
        sampler = state[_SNAPSHOT][_MAIN].get(_SAMPLER)
    else:
        sampler = state.get(_SAMPLER)
    if not isinstance(sampler, Mapping):
        raise ValueError("the loader state holds no batch sampler state: cannot find the sampler's position")
    return sampler


class _DeferredIterator:
    """What ``iter(loader)`` returns: the loader's real iterator, created at the first ``next()``."""

    def __init__(self, loader: ResumableDataLoader) -> None:
        self._loader = loader
        self._iterator: Iterator[Any] | None = None
        self._generation = -1

    def __iter__(self) -> _DeferredIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if self._iterator is None:
            return self._first()
        if self._generation != loader._generation:
            raise RuntimeError(
                "the loader's state was loaded after this iterator had drawn batches: those batches came from "
                "the old position. Call iter(loader) again to continue from the loaded state"
            )
        try:
            return next(self._iterator)
        except RuntimeError as err:
            named = named_timeout(err, loader.name, loader.timeout)
            if named is None:
                raise
            raise named from err

    def _first(self) -> Any:
        """Check the plan across ranks, start the workers, draw the first batch; every rank learns whether every
        rank's workers started (a rank whose workers are stuck makes every rank raise)."""
        loader = self._loader
        check = getattr(loader.batch_sampler, "check_plan", None)
        if check is not None:
            check()  # a collective, in the main process, before any worker starts
        workers = loader.num_workers > 0
        try:
            self._iterator, self._generation = StatefulDataLoader.__iter__(loader), loader._generation
            first = next(self._iterator)
        except StopIteration:
            if workers:
                agree_started(loader.name, loader.timeout)
            raise
        except Exception as err:
            named = named_timeout(err, loader.name, loader.timeout)
            if workers:
                agree_started(loader.name, loader.timeout, error=str(named or f"{type(err).__name__}: {err}"))
            if named is None:
                raise
            raise named from err
        if workers:
            agree_started(loader.name, loader.timeout)
        return first


class ResumableDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` that resumes from its batch sampler's position, whenever the state arrives.

    Same arguments as ``StatefulDataLoader``; the batch sampler must have ``state_dict`` / ``load_state_dict``
    (the planned samplers do), and may have ``check_plan()`` (run before the workers start).

    Args:
        *args: ``StatefulDataLoader``'s.
        name: the loader's name in errors (``"train"``, ``"val"``, ...), the same on every rank.
        loader_timeout: seconds to wait for a worker (see :data:`~lit_seqpack.data.workers.DEFAULT_LOADER_TIMEOUT`);
            with workers, they also start with ``forkserver`` under ``torch.distributed``
            (:func:`~lit_seqpack.data.workers.worker_options`) unless ``multiprocessing_context`` is given.
        **kwargs: ``StatefulDataLoader``'s.
    """

    _generation = 0

    def __init__(
        self, *args: Any, name: str = "loader", loader_timeout: float = DEFAULT_LOADER_TIMEOUT, **kwargs: Any
    ) -> None:
        workers = kwargs.get("num_workers", 0)
        if workers and "multiprocessing_context" not in kwargs and "timeout" not in kwargs:
            dataset = args[0] if args else kwargs.get("dataset")
            kwargs.update(
                worker_options(workers, loader_timeout, dataset, kwargs.get("collate_fn"), kwargs.get("worker_init_fn"))
            )
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13, each time
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(*args, **kwargs)
        self.name = name

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return _DeferredIterator(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict``; with another worker count, from its batch sampler's position only.

        Args:
            state_dict: a ``StatefulDataLoader`` state (``{}``: start fresh).

        Raises:
            ValueError: the state holds no readable sampler position (when the worker count changed).
        """
        self._generation += 1
        if state_dict and (saved := loader_workers(state_dict)) != self.num_workers:
            sampler_state = sampler_state_of(state_dict)
            log.info(
                "Resuming a loader saved with num_workers=%d under num_workers=%d: the batch sampler's position "
                "is restored and the workers start fresh.",
                saved,
                self.num_workers,
            )
            super().load_state_dict({})
            self.next_iter_state = None
            self.batch_sampler.load_state_dict(sampler_state)
            return
        super().load_state_dict(state_dict)
