"""Where a restored Lightning fit loop resumes a stream, going back to the start of an interrupted optimizer step.

A stream loader has no length, so Lightning's prefetching fetcher draws its first batch while it builds the
iterator (``FitLoop.setup_data``), before the training loop resets its restored counters; the indexed pipeline's
:func:`~lit_seqpack.data._trainer.rewind_fit_loop` runs later, at a first batch drawn after that reset. Here the
restored counters are read as Lightning will reset them: the microbatches *processed* (a checkpoint written in
``on_train_batch_end`` counts its microbatch, one written by an exception in the step does not), and a checkpoint
inside a gradient-accumulation window moves them back to the step's first microbatch, which is trained again.

A schedule reading ``trainer.estimated_stepping_batches`` makes Lightning draw that first batch even earlier, before
the counters are restored; the loader then starts at the step's start from the checkpoint's own record and
:class:`RestoredLoopRewind` moves the counters back at the next batch, the first the training loop draws itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["RestoredLoopRewind", "rewind_restored_loop"]

log = logging.getLogger(__name__)

_COUNTERS = ("ready", "started", "processed", "completed")


def rewind_restored_loop(fit_loop: Any, saved: Mapping[str, Any] | None, accumulate: int) -> tuple[int, int]:
    """The ``(epoch, microbatch)`` a restored fit loop resumes the stream at, with its counters moved back to there.

    Args:
        fit_loop: ``trainer.fit_loop``, restored from a checkpoint and not yet reset (``restarting``).
        saved: the checkpoint's loader state on the first iteration after the restore (its ``resume_at`` is the
            Trainer's ``(epoch, processed)`` when it was written), else ``None``.
        accumulate: microbatches per optimizer step.

    Raises:
        RuntimeError: the checkpoint's loader is at another point than the restored loop; or the checkpoint was
            written inside an accumulation window and the loop cannot be moved back (another Lightning version,
            a fetcher that is not Lightning's prefetching one).
    """
    progress = fit_loop.epoch_loop.batch_progress
    epoch, position = fit_loop.epoch_progress.current.processed, progress.current.processed
    recorded = None if saved is None else saved.get("resume_at")
    if recorded is not None and (int(recorded[0]), int(recorded[1])) != (epoch, position):
        raise RuntimeError(
            f"cannot resume the stream exactly: the checkpoint's loader stopped at epoch {recorded[0]}, microbatch "
            f"{recorded[1]} but the Trainer's loop resumes at epoch {epoch}, microbatch {position}; resume from a "
            "checkpoint written by this run's ModelCheckpoint or OnExceptionCheckpoint"
        )
    step, done = divmod(position, accumulate)
    if not done:
        return epoch, position
    if not _move_back(fit_loop, done):
        raise RuntimeError(
            f"cannot resume the stream exactly: the checkpoint was written inside a gradient-accumulation window "
            f"(epoch {epoch}, after microbatch {done} of the {accumulate} of optimizer step {step}) and this "
            "Lightning loop cannot be moved back to the step's start; resume from a checkpoint written at an "
            "optimizer-step boundary (ModelCheckpoint(every_n_train_steps=...))"
        )
    log.info(
        "The checkpoint was written inside a gradient-accumulation window (epoch %d, after microbatch %d of the %d "
        "of optimizer step %d) and holds no partial gradient: resuming the stream from the step's start, "
        "microbatch %d.",
        epoch,
        done,
        accumulate,
        step,
        position - done,
    )
    return epoch, position - done


def _move_back(fit_loop: Any, microbatches: int) -> bool:
    """Move the restored (not yet reset) batch counters back; ``False`` where the loop is not the one known here."""
    try:
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    except ImportError:  # another Lightning: refuse rather than guess
        return False
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    # inside the fetcher's first prefetch: nothing fetched or held yet (training_step(dataloader_iter) fetches itself)
    if type(fetcher) is not _PrefetchDataFetcher or fetcher.fetched or fetcher.batches:
        return False
    progress = fit_loop.epoch_loop.batch_progress
    try:
        trackers = [(tracker, {name: getattr(tracker, name) for name in _COUNTERS})
                    for tracker in (progress.current, progress.total)]  # fmt: skip
    except AttributeError:
        return False
    if any(min(counts.values()) < microbatches for _, counts in trackers):
        return False
    for tracker, counts in trackers:
        for name, value in counts.items():
            setattr(tracker, name, value - microbatches)
    return True


class RestoredLoopRewind:
    """Moves a restored fit loop back by ``microbatches`` at the first batch the training loop draws itself.

    The first batch (drawn before the restore) is passed over; at the next one the loop must be reset from the
    checkpoint with one batch prefetched (``fetched == ready + 1``) and none held, or the resume is refused.

    Args:
        microbatches: the microbatches of the interrupted optimizer step that the checkpoint counts as trained.
    """

    def __init__(self, microbatches: int) -> None:
        self.microbatches, self._batches = microbatches, 0

    def at_batch(self, fit_loop: Any) -> bool:
        """Called as each batch is drawn: ``True`` once the loop was moved back (then it is done).

        Raises:
            RuntimeError: the loop is not in the state known here at the first batch it draws.
        """
        self._batches += 1
        if self._batches == 1:
            return False
        progress, fetcher = fit_loop.epoch_loop.batch_progress, getattr(fit_loop, "_data_fetcher", None)
        ready = progress.current.ready
        if not (_counts_equal(progress.current) and getattr(fetcher, "fetched", None) == ready + 1) or getattr(
            fetcher, "batches", [None]
        ):
            raise RuntimeError(
                "cannot resume the stream exactly: the checkpoint was written inside a gradient-accumulation window "
                f"({self.microbatches} microbatches into an optimizer step) and this Lightning loop cannot be moved "
                "back to the step's start; resume from a checkpoint written at an optimizer-step boundary "
                "(ModelCheckpoint(every_n_train_steps=...))"
            )
        for tracker in (progress.current, progress.total):
            for name in _COUNTERS:
                setattr(tracker, name, getattr(tracker, name) - self.microbatches)
        fetcher.fetched -= self.microbatches
        log.info("Resuming the stream from the start of the interrupted optimizer step (%d microbatches back).",
                 self.microbatches)  # fmt: skip
        return True


def _counts_equal(tracker: Any) -> bool:
    return len({getattr(tracker, name, None) for name in _COUNTERS}) == 1
