"""The torch ``IterableDataset`` of a stream: one rank's collated microbatches, window after window.

Under ``stream_split="replicate"`` every rank (and every DataLoader worker) reads the *same* stream and plans the same
windows (:func:`~lit_seqpack.data.streaming.buffer.stream_windows`); rank ``r`` keeps its own microbatches of each
window's plan, so ranks need no communication to agree, and each sample is trained by exactly one rank. Under
``stream_split="rank"`` the source is the rank's own share, planned for this rank alone (``data_parallel``); the
loader keeps the ranks in lock step (:mod:`~lit_seqpack.data.streaming.loader`); with ``W >= 2`` workers each
worker reads, plans and collates only its own lane of the share and sends one item per window
(:mod:`~lit_seqpack.data.streaming.lanes`). Otherwise (``"replicate"``, or a share without ``split``), with ``W``
workers, worker ``k`` collates the rank's microbatches ``k, k + W, ...`` (counted from the start of the iteration),
which a DataLoader's round robin over its workers returns in order. Each worker therefore holds one window.

Every batch carries, under :data:`STREAM_KEY`, where it comes from (its window's start position in the stream and
its microbatch number, and with a window's first batch the window's digest for the cross-rank check, which every
rank compares at every window);
:class:`~lit_seqpack.data.streaming.loader.StreamingDataLoader` takes that key out before the batch reaches the model,
keeps the few facts a resume needs and compares the digests across ranks in the main process.

Where a stream sample comes from, for errors: its number in the stream and, for file streams, its file and line
(JSONL) or row group and row (Parquet).

:class:`LocatedReader` wraps a stream reader and tags each sample with its stream number and the reader's position
before it (a dict subclass with the same keys, so nothing downstream sees a difference; it pickles as a plain dict).
The file and line are only worked out when an error names the sample (:func:`describe_position`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.sources.streams import StreamSource
from lit_seqpack.data.streaming.buffer import OverlongCounter, StreamWindow, stream_windows
from lit_seqpack.data.streaming.lanes import LanesStart, lane_source
from lit_seqpack.data.streaming.rank_check import WindowDigest, window_digest
from lit_seqpack.planning.plan import PlanConfig

__all__ = [
    "STREAM_KEY",
    "StreamStart",
    "StreamingDataset",
    "LocatedReader",
    "ReadSample",
    "StreamSampleNames",
    "describe_position",
    "stream_sample_name",
]


class _Located(dict):
    """A sample tagged with its stream number and the reader's position before it."""

    __slots__ = ("number", "position")

    def __reduce__(self) -> tuple[Any, ...]:  # a checkpoint holds plain dicts (weights-only loading)
        return (dict, (dict(self),))

    def relocated(self, values: Mapping[str, Any]) -> _Located:
        """``values`` (this sample changed, e.g. truncated) tagged with this sample's number and position."""
        located = _Located(values)
        located.number, located.position = self.number, self.position
        return located


def stream_sample_name(number: int, position: Any, source: Any, share: tuple[int, int] | None = None) -> str:
    """``stream sample 33, data.jsonl, line 34``: the sample's number, in rank 1's share when ranks read their own
    shares (``share=(rank, world_size)``, more than one rank), and its place in its file when the source has files.

    Example:
        >>> stream_sample_name(33, None, object()), stream_sample_name(4, None, object(), share=(1, 2))
        ('stream sample 33', "sample 4 of rank 1's share of the stream")
    """
    where = describe_position(source, position)
    return _numbered(number, share) + (f", {where}" if where else "")


def _numbered(number: int, share: tuple[int, ...] | None) -> str:
    """``share`` may name a lane too, ``(rank, world_size, lane, lanes)`` (numbers then count in the lane)."""
    lane = f"lane {share[2]} of " if share is not None and len(share) == 4 and share[3] > 1 else ""
    if share is not None and share[1] > 1:
        return f"sample {number} of {lane}rank {share[0]}'s share of the stream"
    if lane:
        return f"sample {number} of {lane}the stream"
    return f"stream sample {number}"


class ReadSample:
    """The name of the sample a :class:`LocatedReader` read last (:func:`stream_sample_name`), worked out only when an
    error message formats it: the checks right after the read name the sample with it."""

    __slots__ = ("number", "position", "share", "source")

    def __init__(self, source: Any, share: tuple[int, int] | None) -> None:
        self.source, self.share, self.number, self.position = source, share, 0, None

    def __str__(self) -> str:
        where = describe_position(self.source, self.position)
        return _numbered(self.number, self.share) + (f" ({where})" if where else "")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class LocatedReader(Iterator[Mapping[str, Any]]):
    """A stream reader whose samples know their stream number (from ``first``) and position.

    Args:
        reader: the source's reader.
        first: the stream number of the reader's next sample.
        source: the stream (or this rank's share of it) that ``reader`` reads, to name the file of a sample.
        share: ``(rank, world_size)`` when ``source`` is this rank's share (numbers then count in the share).
    """

    def __init__(self, reader: Any, first: int, *, source: Any = None, share: tuple[int, int] | None = None) -> None:
        self._reader, self._number = reader, first
        self.last = ReadSample(source, share)
        """The name of the sample read last (updated at every read, not a new object: a read costs microseconds)."""

    @property
    def position(self) -> Any:
        return self._reader.position

    def __next__(self) -> Mapping[str, Any]:
        position = getattr(self._reader, "position", None)
        if type(position) is list:  # a tuple of numbers is one object fewer for the garbage collector to walk
            position = tuple(position)
        sample = next(self._reader)
        number, self._number = self._number, self._number + 1
        self.last.number, self.last.position = number, position
        if type(sample) is not dict:
            return sample
        located = _Located(sample)
        located.number, located.position = number, position
        return located


def describe_position(source: Any, position: Any) -> str | None:
    """``"data.jsonl, line 34"`` or ``"data.parquet, row group 2, row 5"`` for a reader position, else ``None``.

    Example:
        >>> class Files:
        ...     files = ["a.parquet"]
        >>> describe_position(Files(), [0, 2, 5])
        'a.parquet, row group 2, row 5'
    """
    files = getattr(source, "files", None)
    if not isinstance(files, list) or not isinstance(position, (list, tuple)) or not position:
        return None
    if not isinstance(position[0], int) or not 0 <= position[0] < len(files):
        return None
    path = files[position[0]]
    if len(position) == 3:
        return f"{path}, row group {position[1]}, row {position[2]}"
    if len(position) == 2:
        try:
            with open(path, "rb") as handle:  # the error path only: count the lines before the sample's offset
                line = handle.read(int(position[1])).count(b"\n") + 1
        except OSError:
            return f"{path}, byte {position[1]}"
        return f"{path}, line {line}"
    return None


class StreamSampleNames(Sequence[int]):
    """The stream numbers of a microbatch's samples, with :meth:`describe` for the collators' errors.

    Args:
        samples: the microbatch's samples (tagged by :class:`LocatedReader`, or not when carried in by a resume).
        source: the stream source (its ``files`` name the file).
        share: ``(rank, world_size)`` when ``source`` is this rank's share of the stream.
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], source: Any, share: tuple[int, int] | None = None) -> None:
        self._samples, self._source, self._share = list(samples), source, share

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return [getattr(sample, "number", None) for sample in self._samples[position]]
        return getattr(self._samples[position], "number", None)

    def describe(self, position: int) -> str:
        """``stream sample 33, data.jsonl, line 34`` (what is known of the sample at ``position``)."""
        sample = self._samples[position]
        number = getattr(sample, "number", None)
        if number is None:
            return "a stream sample carried over from before the resume"
        return stream_sample_name(number, getattr(sample, "position", None), self._source, self._share)


STREAM_KEY = "_stream"
"""The batch key of a microbatch's stream facts (removed by the streaming loader)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StreamStart:
    """Where an iteration starts: the epoch, and for a resume the window to re-read and the microbatch to start at.

    Args:
        epoch: seeds the window plans.
        window: the window record a resume re-reads (``None``: the stream's start); its keys are those of
            :func:`window_record`.
        microbatch: this rank's first microbatch (numbered in the epoch; ``>= window["first_microbatch"]``).
        lanes: where each lane starts when workers read lanes of the rank's share (then ``window`` is ``None``).
    """

    epoch: int = 0
    window: Mapping[str, Any] | None = None
    microbatch: int = 0
    lanes: LanesStart | None = None


def window_record(window: StreamWindow) -> dict[str, Any]:
    """The facts that re-read ``window`` exactly: its stream position, numbers and over-long counts before it."""
    return {
        "window": window.index,
        "start": window.start,
        "first_sample": window.first_sample,
        "first_microbatch": window.first_microbatch,
        "first_step": window.first_step,
        "overlong_before": window.overlong_before,
        "carried": [_as_lists(sample) for sample in window.carried_in],
    }


def _as_lists(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A carried sample as it goes into a checkpoint: arrays as lists (a ``weights_only`` load refuses numpy arrays,
    and tensors would cross from a loader worker one shared-memory handle each)."""
    return {
        key: value.tolist() if isinstance(value, (np.ndarray, torch.Tensor)) else value for key, value in sample.items()
    }


class StreamingDataset(IterableDataset):
    """One rank's collated microbatches of a stream, planned one look-ahead window at a time.

    Args:
        source: the stream (:class:`~lit_seqpack.data.sources.streams.StreamSource`).
        config: the plan of each window (world size, accumulation, budget, algorithm, ...).
        rank: this data-parallel rank.
        window_size: samples per window.
        collator: turns a :class:`~lit_seqpack.batch.Microbatch` of samples into a batch dict.
        overlong: the over-long policy (``"error"``, ``"truncate"``, ``"drop"``, ``"split"``).
        truncation_side: the end ``overlong="truncate"`` cuts (``"right"`` or ``"left"``).
        document_budget: the longest document allowed (``max_tokens`` less per-document padding).
        document_multiple: packed documents are padded to a multiple of this.
        vocab_size: the ids the model embeds (``None``: unchecked); a batch holding a larger id (a stream is never
            scanned up front) raises naming the stream samples and the vocabulary.
        check_samples: samples of each window whose tokens go into its cross-rank digest (sent with the window's
            record; :mod:`~lit_seqpack.data.streaming.rank_check`); 0: no content digest (the window's numbers are
            still compared across ranks, so streams of other lengths never hang).
        seed: picks those samples.
        token_fields: the declared per-token fields, cut with the tokens by ``overlong="truncate"`` and ``"split"``.
        data_parallel: ``(rank, world_size)`` when ``source`` is this rank's own share (``stream_split="rank"``):
            ``config`` then plans this rank alone (``world_size=1``), the batches name the real world size, and
            the loader keeps the ranks in lock step (:mod:`~lit_seqpack.data.streaming.loader`).
    """

    def __init__(
        self,
        source: StreamSource,
        *,
        config: PlanConfig,
        rank: int,
        window_size: int,
        collator: Callable[[Microbatch], dict[str, Any]],
        overlong: str = "error",
        truncation_side: str = "right",
        document_budget: int | None = None,
        document_multiple: int = 1,
        vocab_size: int | None = None,
        check_samples: int = 0,
        seed: int = 0,
        token_fields: tuple[str, ...] = (),
        data_parallel: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank must be in [0, {config.world_size}), got {rank}")
        self.source, self.config, self.rank, self.window_size = source, config, rank, window_size
        self.collator, self.overlong, self.document_multiple = collator, overlong, document_multiple
        self.truncation_side = truncation_side
        self.document_budget = document_budget if document_budget is not None else config.max_tokens
        self.vocab_size, self.check_samples, self.seed = vocab_size, check_samples, seed
        self.token_fields = tuple(token_fields)
        if data_parallel is not None and (config.world_size != 1 or not 0 <= data_parallel[0] < data_parallel[1]):
            raise ValueError(
                f"data_parallel={data_parallel} needs a plan of one rank (config.world_size=1, got "
                f"{config.world_size}) and a rank in [0, world_size)"
            )
        self.data_parallel = data_parallel
        self.start = StreamStart()
        self.lanes = 0
        """Lanes the share is read in, one a loader worker (set by the loader; 0: no lanes)."""
        self._named: tuple[int, ...] | None = data_parallel  # how errors number a sample (its share, its lane)

    @property
    def world_size(self) -> int:
        """The data-parallel ranks training together (written in every batch for the exact loss)."""
        return self.config.world_size if self.data_parallel is None else self.data_parallel[1]

    def filler(self, step: int) -> dict[str, Any]:
        """A lock-step filler of epoch step ``step``: a zero-loss microbatch (its ``step_loss_tokens`` is 0)."""
        config = self.config
        meta = MicrobatchMeta(
            step=step,
            step_loss_tokens=0,
            world_size=self.world_size,
            accumulate_grad_batches=config.accumulate_grad_batches,
            max_tokens=config.max_tokens,
            is_empty=True,
            loss_tokens=0,
        )
        return self.collator(Microbatch((), meta=meta))

    def windows(self) -> Iterator[StreamWindow]:
        """The planned windows from :attr:`start` (every rank and worker gets the same)."""
        return self._windows_of(self.source, self.start.window)

    def _windows_of(self, source: StreamSource, record: Mapping[str, Any] | None) -> Iterator[StreamWindow]:
        """The planned windows of ``source`` (the stream, the rank's share or a lane) from ``record`` (its start)."""
        counter = None
        if self.document_budget is not None:
            counter = OverlongCounter(
                policy=self.overlong,
                max_tokens=self.document_budget,
                token_fields=self.token_fields,
                truncation_side=self.truncation_side,
            )
            if record is not None and record["overlong_before"] is not None:
                counter.load_state(record["overlong_before"])
        numbers = (0, 0, 0, 0)
        if record is not None:
            numbers = (record["window"], record["first_sample"], record["first_microbatch"], record["first_step"])
        return stream_windows(
            LocatedReader(
                source.open(None if record is None else record["start"]),
                numbers[1],
                source=source,
                share=self._named,
            ),
            config=self.config,
            window_size=self.window_size,
            epoch=self.start.epoch,
            counter=counter,
            document_multiple=self.document_multiple,
            start=numbers,
            carried=None if record is None else record["carried"],
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.lanes:
            yield from self._lane_windows(worker, workers)
            return
        first = self.start.microbatch
        for window in self.windows():
            record: dict[str, Any] | None = window_record(window)  # sent with this worker's first batch of it
            for position in range(window.plan.microbatches_per_rank):
                number = window.first_microbatch + position
                if number < first or (number - first) % workers != worker:
                    continue
                yield self._collate(window, position, number, record)
                record = None

    def _lane_windows(self, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        """This worker's lane, one item a window: its remaining microbatches collated and its lock-step facts."""
        start = self.start.lanes if self.start.lanes is not None else LanesStart.fresh(self.lanes)
        if workers != self.lanes or len(start.lanes) != self.lanes:
            raise RuntimeError(
                f"the stream's share is read in {self.lanes} lanes but the loader runs {workers} workers: build the "
                "loader with num_workers equal to the lanes"
            )
        lane = start.lane_of(worker)
        source = lane_source(self.source, lane, self.lanes)
        self._named = (*(self.data_parallel or (0, 1)), lane, self.lanes)  # this worker's copy of the dataset
        first = start.lanes[lane]
        skip = int(first["skip"])
        for window in self._windows_of(source, first["record"]):
            plan = window.plan
            count = plan.microbatches_per_rank
            if skip >= count:  # trained before the resume (or no microbatch at all)
                skip = 0
                continue
            yield {
                "lane": lane,
                "epoch": self.start.epoch,
                "record": window_record(window),
                "skip": skip,
                "microbatches": count,
                "step_loss_tokens": tuple(plan.step_loss_tokens.tolist()),
                "overlong_after": window.overlong_after,
                "batches": [self._batch(window, position) for position in range(skip, count)],
            }
            skip = 0

    def _collate(
        self, window: StreamWindow, position: int, number: int, record: dict[str, Any] | None
    ) -> dict[str, Any]:
        batch = self._batch(window, position)
        batch[STREAM_KEY] = {
            "epoch": self.start.epoch,
            "microbatch": number,
            "record": record,
            "overlong_after": window.overlong_after,
            "digest": self._digest(window) if record is not None and self.data_parallel is None else None,
            # the window's steps for the lock step of ranks reading their own shares
            "steps": (window.first_step, tuple(window.plan.step_loss_tokens.tolist())) if record is not None else None,
        }
        return batch

    def _batch(self, window: StreamWindow, position: int) -> dict[str, Any]:
        """The collated microbatch ``position`` of ``window``'s plan for this rank."""
        config, plan = self.config, window.plan
        planned = plan.microbatch(self.rank, position)
        meta = MicrobatchMeta(
            step=window.first_step + planned.step,
            step_loss_tokens=planned.step_loss_tokens,
            world_size=self.world_size,
            accumulate_grad_batches=config.accumulate_grad_batches,
            max_tokens=config.max_tokens,
            is_empty=not planned.indices,
            loss_tokens=int(window.loss_tokens[planned.indices].sum()) if planned.indices else 0,
        )
        samples = [window.samples[i] for i in planned.indices]
        names = StreamSampleNames(samples, self.source, self._named)
        batch = self.collator(Microbatch(samples, meta=meta, indices=names))
        top_id = int(batch["input_ids"].numpy().max()) if self.vocab_size is not None and planned.indices else 0
        if self.vocab_size is not None and top_id >= self.vocab_size:  # numpy: a torch max costs more here
            top = max(range(len(samples)), key=lambda k: max(samples[k]["input_ids"]))
            raise ValueError(
                f"token id {top_id} of {names.describe(top)} (in stream window "
                f"{window.index}) is outside the model's vocab_size={self.vocab_size}: raise the model's vocab_size "
                "or the stream's vocab_size"
            )
        return batch

    def _digest(self, window: StreamWindow) -> WindowDigest:
        return window_digest(window, epoch=self.start.epoch, samples=self.check_samples, seed=self.seed)
