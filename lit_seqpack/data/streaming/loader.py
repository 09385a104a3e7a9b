"""The streaming DataLoader: batches of a :class:`StreamingDataset`, and the state that resumes it mid-stream.

The state holds the epoch, the microbatches this rank's loader yielded (the same count on every rank, so rank 0's
checkpoint fits all), and a record of the last few windows: each window's stream position, numbers, over-long counts
at its start and the samples carried into it from the window before (at most a fifth of the buffer; no other
sample is ever stored). A resume reopens the stream at the start of the window holding the first microbatch to
train, plans that window again (plans are deterministic) and skips the microbatches already trained. With ``W``
workers and a prefetch of ``P``, the loader is at most ``W x P`` batches ahead of the training loop, and Lightning
one more; :data:`KEPT_WINDOWS` windows (each at least one microbatch) cover that lead for the defaults.

Under ``torch.distributed`` the loader also compares each window's digest across ranks in the main process
(:mod:`~lit_seqpack.data.streaming.rank_check`) at the first batch of every window, and the end of the stream when the
iteration runs out, so streams that differ anywhere (the tail included) raise on every rank instead of hanging. An
iteration from the stream's start that yields no microbatch (an empty stream, or every sample dropped) raises on
every rank, naming the stream: an empty epoch would otherwise train nothing silently, or loop forever under
``max_steps``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader

from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.sources.streams import describe_stream
from lit_seqpack.data.streaming.buffer import OverlongCounter
from lit_seqpack.data.streaming.dataset import STREAM_KEY, StreamingDataset, StreamStart
from lit_seqpack.data.streaming.rank_check import WindowDigest, check_ranks_agree, stream_end

__all__ = ["KEPT_WINDOWS", "StreamingDataLoader"]

log = logging.getLogger(__name__)

KEPT_WINDOWS = 16
"""Window records kept in the state (the loader's lead over the loop must stay below this many microbatches)."""

StartSource = Callable[[int, int, "Mapping[str, Any] | None"], tuple[int, int]]
"""``(epoch, microbatch, saved state or None) -> (epoch, microbatch)``: where the training loop says to start."""


def _as_collated(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


class StreamingDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`StreamingDataset` that removes the stream facts from each batch and keeps
    what an exact mid-stream resume needs (:meth:`state_dict` / :meth:`load_state_dict`).

    Args:
        dataset: the rank's streaming dataset.
        num_workers: worker processes (each reads the stream and holds one window).
        start_source: asked at each iteration's first batch where to start (the DataModule passes the Trainer's
            epoch and batch counter); ``None``: the loader's own position.
        report_to: called with the over-long report whenever a new window arrives (the DataModule keeps it in
            its ``overlong_report``); a summary is also logged at the end of each epoch with over-long samples.
        on_batch: called in the main process as each batch is drawn, before it is returned (the DataModule moves a
            restored training loop back to an optimizer step's start there).
        **kwargs: other ``DataLoader`` arguments (``pin_memory``, ``prefetch_factor``, ...).
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        *,
        num_workers: int = 0,
        start_source: StartSource | None = None,
        report_to: Callable[[OverlongReport], None] | None = None,
        on_batch: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "persistent_workers=True would keep each worker's copy of the stream's start: an iteration after a "
                "resume or a new epoch would replay the old one; leave persistent_workers=False with a stream"
            )
        # batches come collated: torch's default conversion would only walk each one (a tenth of the loader's time)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_collated, **kwargs)
        self.start_source, self.report_to, self.on_batch = start_source, report_to, on_batch
        self._epoch, self._yielded = 0, 0
        self._windows: deque[dict[str, Any]] = deque(maxlen=KEPT_WINDOWS)
        self._overlong: dict[str, Any] | None = None
        self._saved: dict[str, Any] | None = None
        self._checked: WindowDigest | None = None  # the window last compared across ranks this iteration

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        """Starts the real iterator at the first ``next()``, so a state loaded after ``iter()`` is still used."""
        start = self.dataset.start = self._start()
        self._checked = None
        yielded = 0
        for batch in super().__iter__():
            facts = batch.pop(STREAM_KEY)
            self._check(facts)
            self._record(facts)
            yielded += 1
            if self.on_batch is not None:
                self.on_batch()
            yield batch
        check_ranks_agree(stream_end(start.epoch, self._checked))  # a rank with more windows meets this end here
        if not yielded and start.microbatch == 0:
            raise ValueError(
                f"the stream {describe_stream(self.dataset.source)} gave no microbatch in epoch {start.epoch}: it is "
                "empty (or overlong='drop' dropped every sample); an empty epoch would train nothing, or loop "
                "forever under max_steps: check the stream's paths and contents"
            )
        report = self.overlong_report
        if report is not None and report.num_overlong:
            log.warning("lit_seqpack: stream epoch %d: %s", self._epoch, report.summary())
        self._epoch, self._yielded = self._epoch + 1, 0
        self._windows.clear()

    def _start(self) -> StreamStart:
        saved, self._saved = self._saved, None
        epoch, position = (saved["epoch"], saved["yielded"]) if saved is not None else (self._epoch, self._yielded)
        if self.start_source is not None:
            epoch, position = self.start_source(epoch, position, saved)
        windows = saved["windows"] if saved is not None and saved["epoch"] == epoch else list(self._windows)
        self._epoch, self._yielded = epoch, position
        self._windows = deque((w for w in windows if w["first_microbatch"] <= position), maxlen=KEPT_WINDOWS)
        if position == 0:
            self._windows.clear()
            self._overlong = None
            return StreamStart(epoch=epoch)
        if not self._windows:
            raise RuntimeError(
                f"cannot resume the stream exactly at epoch {epoch}, microbatch {position}: the loader state holds no "
                "window starting at or before it (the state was written more than "
                f"{KEPT_WINDOWS} windows ahead of the loop); resume from a checkpoint written by ModelCheckpoint"
            )
        return StreamStart(epoch=epoch, window=self._windows[-1], microbatch=position)

    def _check(self, facts: dict[str, Any]) -> None:
        """Compare the window's digest across ranks at its first batch (every worker sends it: compared once).

        Every rank runs the same sequence of checks (one per window with a microbatch, then the stream's end), so a
        rank never waits for a collective that another rank skips before the first difference, which raises on all.
        """
        digest = facts.get("digest")
        if digest is None or (self._checked is not None and digest.window == self._checked.window):
            return
        self._checked = digest
        check_ranks_agree(digest)

    def _record(self, facts: dict[str, Any]) -> None:
        record = facts["record"]
        self._epoch, self._yielded = facts["epoch"], facts["microbatch"] + 1
        self._overlong = facts["overlong_after"]
        if record is not None and (not self._windows or self._windows[-1]["window"] != record["window"]):
            self._windows.append(record)
            report = self.overlong_report
            if self.report_to is not None and report is not None:
                self.report_to(report)

    # ------------------------------------------------------------------ state
    @property
    def overlong_report(self) -> OverlongReport | None:
        """The over-long policy's counts over the stream read so far this epoch (``None`` before any batch)."""
        dataset = self.dataset
        if self._overlong is None or dataset.document_budget is None:
            return None
        counter = OverlongCounter(policy=dataset.overlong, max_tokens=dataset.document_budget)
        counter.load_state(self._overlong)
        return counter.report()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the microbatches yielded this epoch and the last windows' records."""
        return {"epoch": self._epoch, "yielded": self._yielded, "windows": list(self._windows)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next iteration (``{}``: start fresh)."""
        if not state_dict:
            self._saved = None
            return
        missing = {"epoch", "yielded", "windows"} - set(state_dict)
        if missing:
            raise ValueError(f"not a streaming loader state: missing {sorted(missing)}")
        self._saved = dict(state_dict)
