"""The torch ``IterableDataset`` of a stream: one rank's collated microbatches, window after window.

Under ``stream_split="replicate"`` every rank (and every DataLoader worker) reads the *same* stream and plans the same
windows (:func:`~lit_seqpack.data.streaming.buffer.stream_windows`); rank ``r`` keeps its own microbatches of each
window's plan, so ranks need no communication to agree, and each sample is trained by exactly one rank. Under
``stream_split="rank"`` the source is the rank's own share, planned for this rank alone (``data_parallel``); the
loader keeps the ranks in lock step (:mod:`~lit_seqpack.data.streaming.lockstep`); with ``W >= 2`` workers each
worker reads, plans and collates only its own lane of the share and sends one item per window
(:mod:`~lit_seqpack.data.streaming.lanes`). Otherwise (``"replicate"``, or a share without ``split``), with ``W``
workers, worker ``k`` collates the rank's microbatches ``k, k + W, ...`` (counted from the start of the iteration),
which a DataLoader's round robin over its workers returns in order. Each worker therefore holds one window.

Every batch carries, under :data:`STREAM_KEY`, where it comes from (its window's start position in the stream and
its microbatch number, and with a window's first batch the window's digest for the cross-rank check, which every
rank compares at every window);
:class:`~lit_seqpack.data.streaming.loader.StreamingDataLoader` takes that key out before the batch reaches the model,
keeps the few facts a resume needs and compares the digests across ranks in the main process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.sources.streams import StreamSource
from lit_seqpack.data.streaming._where import LocatedReader, StreamSampleNames
from lit_seqpack.data.streaming.buffer import OverlongCounter, StreamWindow, stream_windows
from lit_seqpack.data.streaming.lanes import LanesStart, lane_source
from lit_seqpack.data.streaming.rank_check import WindowDigest, window_digest
from lit_seqpack.planning.plan import PlanConfig

__all__ = ["STREAM_KEY", "StreamStart", "StreamingDataset"]

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
            the loader keeps the ranks in lock step (:mod:`~lit_seqpack.data.streaming.lockstep`).
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
