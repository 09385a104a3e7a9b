"""The streaming DataLoader: batches of a :class:`StreamingDataset`, and the state that resumes it mid-stream.

The state holds the epoch, the microbatches this rank's loader yielded (the same count on every rank, so rank 0's
checkpoint fits all), and a record of the last few windows: each window's stream position, numbers, over-long counts
at its start and the samples carried into it from the window before (at most a third of the buffer; no other
sample is ever stored). A resume reopens the stream at the start of the window holding the first microbatch to
train, plans that window again (plans are deterministic) and skips the microbatches already trained. With ``W``
workers and a prefetch of ``P``, the loader is at most ``W x P`` batches ahead of the training loop, and Lightning
one more; :data:`KEPT_WINDOWS` windows (each at least one microbatch) cover that lead for the defaults.

With ``stream_split="rank"`` the state also holds every rank's window records (``"shares"``, gathered when the
state is built, which every rank does at a checkpoint), and the loader keeps the ranks in lock step
(:mod:`~lit_seqpack.data.streaming.loader`): one collective whenever a rank reads its next window, fillers once a
rank's share has ended, ``step_loss_tokens`` summed over the ranks. There, with ``W >= 2`` workers, each worker reads
its own lane of the rank's share and sends one item a window (:mod:`~lit_seqpack.data.streaming.lanes`): a prefetch of
``P`` then holds up to ``W x P`` windows of collated microbatches, and the state holds each lane's window records
(``"lanes"``) instead of ``"windows"``; a resume with another ``num_workers`` is refused.

Under ``stream_split="replicate"`` and ``torch.distributed`` the loader compares each window's digest across ranks
in the main process
(:mod:`~lit_seqpack.data.streaming.rank_check`) at the first batch of every window, and the end of the stream when the
iteration runs out, so streams that differ anywhere (the tail included) raise on every rank instead of hanging. An
iteration from the stream's start that yields no microbatch (an empty stream, or every sample dropped) raises on
every rank, naming the stream: an empty epoch would otherwise train nothing silently, or loop forever under
``max_steps``.

Lock step for ranks that read their own shares of a stream (``stream_split="rank"``): one small collective a window.

Each rank plans the windows of its own share alone (so its ``k``-th optimizer step is the epoch's step ``k``), and
knows the steps of the windows it has read. Before step ``j`` every rank must know every rank's loss tokens of step
``j`` (the exact-loss normaliser is the step's total over all ranks). So whenever some rank has not yet read the
window holding step ``j``, every rank calls one ``all_gather_object``: the ranks lacking that window read it (its
step count and loss tokens per step, :class:`ShareFacts`) or say their share has ended, the others send nothing
new. Every rank sees the same gathered facts and so decides the next collective alike: every collective runs on
every rank the same number of times, and no rank ever waits for one another skips.

A rank whose share has ended yields lock-step fillers (zero-loss microbatches) until every rank's share has ended;
then the epoch ends on every rank at the same microbatch. A rank's plan is never changed by the others, so a
checkpoint needs each rank's own window records only; the collectives are replayed from there on resume.

Example:
    >>> lock = LockStep(rank=0, world_size=2, epoch=0)
    >>> lock.exchange([ShareFacts(epoch=0, first_step=0, step_loss_tokens=(5, 7)), ShareFacts(epoch=0, ended=True)])
    >>> lock.missing(1), lock.step_loss_tokens(1), lock.runs_own(1), lock.missing(2)  # rank 0 must read on at step 2
    ([], 7, True, [0])
    >>> lock.exchange([ShareFacts(epoch=0, ended=True), ShareFacts(epoch=0, idle=True)])
    >>> lock.finished(2)
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.sources.streams import describe_stream
from lit_seqpack.data.streaming.buffer import OverlongCounter
from lit_seqpack.data.streaming.dataset import STREAM_KEY, StreamingDataset, StreamStart
from lit_seqpack.data.streaming.lanes import (
    LaneHistory,
    lane_count,
    lane_source,
    merged_overlong,
    splits_by_worker,
)
from lit_seqpack.data.streaming.rank_check import WindowDigest, check_ranks_agree, stream_end
from lit_seqpack.data.workers import DEFAULT_LOADER_TIMEOUT, agree_started, named_timeout, worker_options

__all__ = ["KEPT_WINDOWS", "StreamingDataLoader", "Gather", "LockStep", "ShareFacts", "gather_object"]


Gather = Callable[[Any], Sequence[Any]]
"""``value -> every data-parallel rank's value``, in rank order (an ``all_gather_object``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShareFacts:
    """What one rank sends in a lock-step collective.

    Args:
        epoch: the epoch the rank reads (ranks in different epochs raise).
        first_step: the epoch step of the window's first step.
        step_loss_tokens: the loss tokens of each of the window's steps, on this rank.
        ended: the rank's share has no more window this epoch.
        idle: the rank had no window to read for this collective (it knows its next steps already).
        error: reading the rank's next window failed (a bad line, an over-long sample under ``overlong="error"``):
            every rank raises, naming it, instead of waiting for that rank at the next collective.
    """

    epoch: int
    first_step: int = 0
    step_loss_tokens: tuple[int, ...] = ()
    ended: bool = False
    idle: bool = False
    error: str | None = None


def gather_object(value: Any, world_size: int, rank: int) -> list[Any]:
    """Every data-parallel rank's ``value`` (one ``all_gather_object``); ``[value]`` without ``torch.distributed``.

    Each process sends its data-parallel ``rank`` with its value, so the model-parallel (tensor / context parallel)
    processes of a data-parallel rank are found wherever the strategy's device mesh places them
    (:func:`_data_parallel`).

    Example:
        >>> gather_object({"steps": 3}, world_size=1, rank=0)
        [{'steps': 3}]
    """
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, value))
    return _data_parallel(everyone, world_size)


def _data_parallel(everyone: Sequence[tuple[int, Any]], world_size: int) -> list[Any]:
    """One value per data-parallel rank, in rank order, from every process's ``(data-parallel rank, value)``.

    The model-parallel processes of a data-parallel rank read the same share and send the same value; where they
    sit among the global ranks is the mesh's business (:class:`~lit_seqpack.parallel.ParallelLayout` and Lightning's
    ``ModelParallelStrategy`` put them innermost, a custom mesh may not), so they are found by the rank they send.

    Raises:
        RuntimeError: on every process alike, when the processes do not hold ``world_size`` data-parallel ranks of
            equal size, or the processes of one data-parallel rank sent different values (their shares diverged:
            one failed to read, or a layout is wrong), naming the global ranks.

    Example:
        >>> _data_parallel([(0, "a"), (0, "a"), (1, "b"), (1, "b")], world_size=2)  # 2 data- x 2 tensor-parallel
        ['a', 'b']
    """
    groups: dict[int, list[int]] = {}
    for process, (rank, _) in enumerate(everyone):
        groups.setdefault(rank, []).append(process)
    sizes = {len(processes) for processes in groups.values()}
    if sorted(groups) != list(range(world_size)) or len(sizes) != 1:
        found = {rank: processes for rank, processes in sorted(groups.items())}
        raise RuntimeError(
            f"{len(everyone)} processes cannot hold {world_size} data-parallel ranks of equal size: the global ranks "
            f"of each data-parallel rank are {found}"
        )
    values = []
    for rank in range(world_size):
        first, *peers = groups[rank]
        differ = [process for process in peers if not _same(everyone[process][1], everyone[first][1])]
        if differ:
            raise RuntimeError(
                f"the model-parallel processes of data-parallel rank {rank} (global ranks {groups[rank]}) read "
                f"different stream shares: global rank {first} sent {everyone[first][1]!r}, global rank {differ[0]} "
                f"sent {everyone[differ[0]][1]!r}"
            )
        values.append(everyone[first][1])
    return values


def _same(one: Any, other: Any) -> bool:
    """Whether two gathered values are equal (by their pickles where ``==`` is ambiguous, e.g. numpy arrays inside)."""
    try:
        return bool(one == other)
    except (TypeError, ValueError):
        return pickle.dumps(one) == pickle.dumps(other)


class LockStep:
    """The steps every rank has read, their loss tokens over all ranks, and which ranks have ended.

    Args:
        rank: this data-parallel rank.
        world_size: the data-parallel ranks.
        epoch: the epoch being read.
        gather: ``value -> every data-parallel rank's value`` (:func:`gather_object` by default).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        epoch: int,
        gather: Gather | None = None,
    ) -> None:
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.gather = gather or (lambda value: gather_object(value, world_size, rank))
        self.known = [0] * world_size  # each rank's steps read so far (the end of its last window's steps)
        self.ended = [False] * world_size
        self.any_step = False  # some rank had a step this iteration
        self.collectives = 0
        self._totals: dict[int, int] = {}

    def missing(self, step: int) -> list[int]:
        """The ranks that must read a window (or end) before ``step`` can run."""
        return [r for r in range(self.world_size) if not self.ended[r] and self.known[r] <= step]

    def runs_own(self, step: int) -> bool:
        """Whether this rank trains its own microbatches at ``step`` (else a filler)."""
        return self.known[self.rank] > step

    def finished(self, step: int) -> bool:
        """Whether every rank's share ended before ``step``: the epoch ends here on every rank."""
        return all(self.ended) and max(self.known) <= step

    def step_loss_tokens(self, step: int) -> int:
        """The loss tokens of ``step`` over all ranks."""
        return self._totals.get(step, 0)

    def forget(self, step: int) -> None:
        """Drop what is known of ``step`` (trained): memory holds the steps of the windows being read only."""
        self._totals.pop(step, None)

    def exchange(self, everyone: Sequence[ShareFacts] | None = None, mine: ShareFacts | None = None) -> None:
        """One collective: send ``mine`` (or an idle note), fold in every rank's facts (``everyone``: given, in tests).

        Raises:
            RuntimeError: on every rank, when the ranks read different epochs or a rank failed to read its window.
        """
        if everyone is None:
            everyone = self.gather(mine or ShareFacts(epoch=self.epoch, idle=True))
        self.collectives += 1
        failed = [(r, facts.error) for r, facts in enumerate(everyone) if facts.error is not None]
        if failed:
            said = "; ".join(f"rank {r}: {error}" for r, error in failed)
            raise RuntimeError(f"reading the stream shares failed on rank(s) {[r for r, _ in failed]} ({said})")
        epochs = {facts.epoch for facts in everyone}
        if len(epochs) > 1:
            at = ", ".join(f"rank {r}: epoch {facts.epoch}" for r, facts in enumerate(everyone))
            raise RuntimeError(
                f"the ranks read their stream shares in different epochs at the same lock-step collective ({at}): "
                "every rank must run the same epochs (resume every rank from the same checkpoint)"
            )
        for r, facts in enumerate(everyone):
            if facts.idle:
                continue
            if facts.ended:
                self.ended[r] = True
                continue
            for k, loss in enumerate(facts.step_loss_tokens):
                self._totals[facts.first_step + k] = self._totals.get(facts.first_step + k, 0) + int(loss)
            self.known[r] = facts.first_step + len(facts.step_loss_tokens)
            self.any_step = self.any_step or bool(facts.step_loss_tokens)


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
        num_workers: worker processes (each reads the stream and holds one window; under ``stream_split="rank"``
            each reads its own lane of the rank's share, :mod:`~lit_seqpack.data.streaming.lanes`).
        start_source: asked at each iteration's first batch where to start (the DataModule passes the Trainer's
            epoch and batch counter); ``None``: the loader's own position.
        report_to: called with the over-long report whenever a new window arrives (the DataModule keeps it in
            its ``overlong_report``); a summary is also logged at the end of each epoch with over-long samples.
        on_batch: called in the main process as each batch is drawn, before it is returned (the DataModule moves a
            restored training loop back to an optimizer step's start there).
        gather: ``value -> every data-parallel rank's value``, the lock step's collective (shares read by rank;
            default: ``torch.distributed.all_gather_object``; a test or a benchmark simulates ranks with threads).
        loader_timeout: seconds to wait for a worker's window (:mod:`~lit_seqpack.data.workers`): a stuck worker
            raises, naming the loader and the rank, and the lock step's collective (or, for a replicated stream,
            the workers' start-up agreement) makes every rank raise with it.
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
        gather: Gather | None = None,
        loader_timeout: float = DEFAULT_LOADER_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "persistent_workers=True would keep each worker's copy of the stream's start: an iteration after a "
                "resume or a new epoch would replay the old one; leave persistent_workers=False with a stream"
            )
        if num_workers and "multiprocessing_context" not in kwargs and "timeout" not in kwargs:
            kwargs.update(worker_options(num_workers, loader_timeout, dataset))
        # batches come collated: torch's default conversion would only walk each one (a tenth of the loader's time)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_collated, **kwargs)
        self.start_source, self.report_to, self.on_batch = start_source, report_to, on_batch
        rank, world_size = dataset.data_parallel or (dataset.rank, dataset.world_size)
        self.gather: Gather = gather or (lambda value: gather_object(value, world_size, rank))
        self._epoch, self._yielded = 0, 0
        self._windows: deque[dict[str, Any]] = deque(maxlen=KEPT_WINDOWS)
        self._overlong: dict[str, Any] | None = None
        self._saved: dict[str, Any] | None = None
        self._checked: WindowDigest | None = None  # the window last compared across ranks this iteration
        dataset.lanes = lane_count(dataset.source, num_workers) if dataset.data_parallel is not None else 0
        splitting = splits_by_worker(dataset.source) if num_workers > 1 and not dataset.lanes else None
        if splitting is not None:  # each worker would read its own part of what every worker must read whole
            raise ValueError(
                f"num_workers={num_workers}: {describe_stream(splitting)} splits itself among DataLoader workers (by "
                "shard), but each stream loader worker must read the whole stream (or share) to plan its windows, "
                "so samples would be lost or repeated silently: set num_workers=0 or 1"
            )
        if dataset.lanes:
            lane_source(dataset.source, 0, dataset.lanes)  # refused here (not in a worker) if it cannot be split
            if kwargs.get("in_order") is False:
                raise ValueError(
                    "in_order=False would return the lanes' windows in another order on every run (and resume): "
                    "leave in_order=True with stream_split='rank' and num_workers >= 2"
                )
        # the loader's lead is at most W x P windows (and the loop's): the history covers it
        lead = num_workers * (kwargs.get("prefetch_factor") or 2)
        self._history = LaneHistory(dataset.lanes, kept=KEPT_WINDOWS + lead) if dataset.lanes else None
        self._lane_overlong: list[dict[str, Any] | None] = [None] * dataset.lanes

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        """Starts the real iterator at the first ``next()``, so a state loaded after ``iter()`` is still used."""
        start = self.dataset.start = self._start()
        if self.dataset.data_parallel is None:
            yield from self._replicated(start)
        else:
            yield from self._lock_step(start)
        report = self.overlong_report
        if report is not None and report.num_overlong:
            share = self.dataset.data_parallel  # the report counts this rank's share; its numbers count in the share
            whose = f", rank {share[0]}'s share" if share is not None and share[1] > 1 else ""
            log.warning("lit_seqpack: stream epoch %d%s: %s", self._epoch, whose, report.summary())
        self._epoch, self._yielded = self._epoch + 1, 0
        self._windows.clear()
        if self._history is not None:
            self._history.reset()

    def _replicated(self, start: StreamStart) -> Iterator[dict[str, Any]]:
        """Every rank reads the whole stream: the windows' digests and the stream's end are compared across ranks."""
        self._checked = None
        yielded = 0
        for batch in self._dataset_batches():
            facts = batch.pop(STREAM_KEY)
            self._check(facts)
            self._record(facts)
            yielded += 1
            if self.on_batch is not None:
                self.on_batch()
            yield batch
        check_ranks_agree(stream_end(start.epoch, self._checked))  # a rank with more windows meets this end here
        if not yielded and start.microbatch == 0:
            self._refuse_empty(start.epoch)

    def _lock_step(self, start: StreamStart) -> Iterator[dict[str, Any]]:
        """Every rank reads its own share: lock step and the step's loss tokens over all ranks from one collective
        per window (:mod:`~lit_seqpack.data.streaming.loader`), fillers once a rank's share has ended."""
        dataset = self.dataset
        rank, world_size = dataset.data_parallel  # type: ignore[misc]
        accumulate = dataset.config.accumulate_grad_batches
        lock = LockStep(rank=rank, world_size=world_size, epoch=start.epoch, gather=self.gather)
        batches, pending = (self._lane_batches(start) if dataset.lanes else self._dataset_batches()), None
        number = start.microbatch
        while True:
            step = number // accumulate
            while missing := lock.missing(step):
                mine = None
                if rank in missing:  # this rank's next window (its first batch carries the window's steps), or its end
                    try:
                        pending = next(batches, None)
                    except Exception as err:  # every rank raises with it at this collective: none waits for this one
                        with contextlib.suppress(RuntimeError):  # this rank raises its own error
                            lock.exchange(mine=ShareFacts(epoch=start.epoch, error=f"{type(err).__name__}: {err}"))
                        raise
                    mine = _share_facts(pending, start.epoch)
                lock.exchange(mine=mine)
            if lock.finished(step):
                break
            if lock.runs_own(step):
                batch, pending = (pending if pending is not None else next(batches, None)), None
                if batch is None or batch[STREAM_KEY]["microbatch"] != number:
                    raise RuntimeError(f"the stream loader lost microbatch {number} of epoch {start.epoch}")
                self._record(batch.pop(STREAM_KEY))
            else:
                batch = dataset.filler(step)
                self._epoch, self._yielded = start.epoch, number + 1
            batch["step_loss_tokens"] = lock.step_loss_tokens(step)
            if number % accumulate == accumulate - 1:
                lock.forget(step)
            number += 1
            if self.on_batch is not None:
                self.on_batch()
            yield batch
        if not lock.any_step and start.microbatch == 0:
            self._refuse_empty(start.epoch)

    def _lane_batches(self, start: StreamStart) -> Iterator[dict[str, Any]]:
        """The lanes' window items as the rank's batches: each window gets its rank-level first microbatch and step
        (running counts in arrival order), its first batch the window's steps (:func:`_share_facts`)."""
        lanes, history = start.lanes, self._history
        assert lanes is not None and history is not None
        microbatch, step = lanes.microbatch, lanes.step
        for item in self._worker_batches(agree=False):
            losses = item["step_loss_tokens"]
            history.arrive(item["lane"], item["record"], microbatch=microbatch, step=step, item=item)
            self._lane_overlong[item["lane"]] = item["overlong_after"]
            self._overlong = merged_overlong(self._lane_overlong)
            report = self.overlong_report
            if self.report_to is not None and report is not None:
                self.report_to(report)
            for k, batch in enumerate(item["batches"]):
                number = microbatch + item["skip"] + k
                batch[STREAM_KEY] = {
                    "epoch": item["epoch"],
                    "microbatch": number,
                    "record": None,
                    "overlong_after": self._overlong,
                    "steps": (step, losses) if k == 0 else None,
                }
                yield batch
            microbatch, step = microbatch + item["microbatches"], step + len(losses)

    def _dataset_batches(self) -> Iterator[dict[str, Any]]:
        """The dataset's batches: through the worker processes, or without workers (and without pinning) straight
        from the dataset, sparing the DataLoader's per-batch machinery (a tenth of a small microbatch's cost)."""
        if self.num_workers == 0 and not self.pin_memory:
            return iter(self.dataset)
        return self._worker_batches(agree=self.dataset.data_parallel is None and self.num_workers > 0)

    def _worker_batches(self, *, agree: bool) -> Iterator[Any]:
        """The workers' items; a timeout names the loader and the rank. ``agree``: every rank learns whether every
        rank's workers gave a first item (a replicated stream's first collective would otherwise wait for a stuck
        rank; the lock step's own collective carries a rank's error)."""
        iterator, first = super().__iter__(), agree
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                if first:
                    agree_started("stream", self.timeout)
                return
            except Exception as err:
                named = named_timeout(err, "stream", self.timeout)
                if first:
                    agree_started("stream", self.timeout, error=str(named or f"{type(err).__name__}: {err}"))
                if named is None:
                    raise
                raise named from err
            if first:
                agree_started("stream", self.timeout)
                first = False
            yield item

    def _refuse_empty(self, epoch: int) -> None:
        raise ValueError(
            f"the stream {describe_stream(self.dataset.source)} gave no microbatch in epoch {epoch}: it is "
            "empty (or overlong='drop' dropped every sample); an empty epoch would train nothing, or loop "
            "forever under max_steps: check the stream's paths and contents"
        )

    def _start(self) -> StreamStart:
        saved, self._saved = self._saved, None
        epoch, position = (saved["epoch"], saved["yielded"]) if saved is not None else (self._epoch, self._yielded)
        if self.start_source is not None:
            epoch, position = self.start_source(epoch, position, saved)
        if self._history is not None:
            return self._lanes_start(saved, epoch, position)
        windows = saved["windows"] if saved is not None and saved["epoch"] == epoch else list(self._windows)
        self._epoch, self._yielded = epoch, position
        self._windows = deque((w for w in windows if w["first_microbatch"] <= position), maxlen=KEPT_WINDOWS)
        if position == 0:
            self._windows.clear()
            self._overlong = None
            return StreamStart(epoch=epoch)
        if not self._windows and self.dataset.data_parallel is not None:
            return StreamStart(epoch=epoch, microbatch=position)  # a share that ended (or was empty): read it again
        if not self._windows:
            raise RuntimeError(
                f"cannot resume the stream exactly at epoch {epoch}, microbatch {position}: the loader state holds no "
                "window starting at or before it (the state was written more than "
                f"{KEPT_WINDOWS} windows ahead of the loop); resume from a checkpoint written by ModelCheckpoint"
            )
        return StreamStart(epoch=epoch, window=self._windows[-1], microbatch=position)

    def _lanes_start(self, saved: dict[str, Any] | None, epoch: int, position: int) -> StreamStart:
        """Where each lane starts so that the rank continues at ``position`` (:meth:`LaneHistory.start_at`)."""
        history = self._history
        assert history is not None
        if saved is not None and saved["epoch"] == epoch:
            history.load(saved["lanes"])
        if position == 0:
            history.reset()
        self._epoch, self._yielded = epoch, position
        lanes = history.start_at(position)
        self._lane_overlong = [lane["overlong"] for lane in lanes.lanes]
        self._overlong = merged_overlong(self._lane_overlong)
        return StreamStart(epoch=epoch, microbatch=position, lanes=lanes)

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
        if self._history is not None:  # the lanes' windows are recorded as they arrive (_lane_batches)
            self._epoch, self._yielded = facts["epoch"], facts["microbatch"] + 1
            return
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
        counter = OverlongCounter(
            policy=dataset.overlong,
            max_tokens=dataset.document_budget,
            truncation_side=getattr(dataset, "truncation_side", "right"),
        )
        counter.load_state(self._overlong)
        return counter.report()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the microbatches yielded this epoch and the last windows' records.

        With shares read by rank, the records of every rank's share are gathered under ``"shares"`` (one
        ``all_gather_object``: every rank builds its state at a checkpoint, rank 0 writes it), so the checkpoint
        resumes every rank.
        """
        state: dict[str, Any] = {"epoch": self._epoch, "yielded": self._yielded, "windows": list(self._windows)}
        if self._history is not None:
            state["num_workers"], state["lanes"] = self.dataset.lanes, self._history.state()
        if self.dataset.data_parallel is not None:
            state["shares"] = list(self.gather(state["lanes"] if self._history is not None else state["windows"]))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next iteration (``{}``: start fresh)."""
        if not state_dict:
            self._saved = None
            return
        missing = {"epoch", "yielded", "windows"} - set(state_dict)
        if missing:
            raise ValueError(f"not a streaming loader state: missing {sorted(missing)}")
        self._saved = dict(state_dict)
        share, lanes = self.dataset.data_parallel, self.dataset.lanes
        if share is None and ("shares" in state_dict or "lanes" in state_dict):
            raise ValueError(
                "cannot resume the stream: the checkpoint was written with stream_split='rank' (each rank read its "
                "own share) but this run reads stream_split='replicate'; resume with the checkpoint's stream_split"
            )
        if share is not None and share[1] > 1:
            shares = state_dict.get("shares")
            if shares is None or len(shares) != share[1]:
                had = "stream_split='replicate'" if shares is None else f"stream_split='rank' on {len(shares)} ranks"
                raise ValueError(
                    f"cannot resume the stream: the checkpoint was written with {had}, this run reads "
                    f"stream_split='rank' on {share[1]} ranks; resume with the checkpoint's world size and stream_split"
                )
            self._saved["lanes" if lanes else "windows"] = shares[share[0]]
        written = state_dict.get("num_workers", 0)
        if written != lanes:
            had = f"num_workers={written} (a lane a worker)" if written else "num_workers=0 or 1 (no lanes)"
            raise ValueError(
                f"cannot resume the stream: the checkpoint was written with {had} under stream_split='rank', where "
                f"each loader worker reads its own lane of the rank's share; this run has num_workers="
                f"{self.num_workers}: resume with num_workers={written or '0 or 1'} (the windows depend on the lanes)"
            )


def _share_facts(batch: dict[str, Any] | None, epoch: int) -> ShareFacts:
    """What this rank sends when it reads its next window: the window's steps (its first batch), or its end."""
    if batch is None:
        return ShareFacts(epoch=epoch, ended=True)
    facts = batch[STREAM_KEY]
    first_step, losses = facts["steps"]
    return ShareFacts(epoch=facts["epoch"], first_step=first_step, step_loss_tokens=losses)
