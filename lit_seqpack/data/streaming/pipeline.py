"""``StreamPipeline``: a stream source under the batching settings, as a loader, a checkpoint state and a prefix.

The DataModule builds it for a :class:`~lit_seqpack.data.sources.streams.StreamSource` and delegates every hook to
it. A resume must keep every fact the window plans depend on (:meth:`StreamPipeline.facts`); a different one is
refused with a message naming it, since re-planned windows would train other microbatches than the checkpointed
run.

A stream's prefix as training reads it: the samples ``lit-seqpack inspect`` plans and the microbatches they train in.

Under ``stream_split="replicate"`` every rank reads the stream from its start, so the prefix is the stream's first
``max_samples`` samples, planned for all ranks at once. Under ``stream_split="rank"`` rank ``r`` reads its own share
(``source.split(r, world_size)``) from the share's start: what training reads first is the first samples of *each
share*, not the stream's first samples dealt out (a JSONL stream is split by bytes: its first lines all belong to rank
0's share). So the prefix of ``max_samples`` samples is :func:`share_sizes` samples from the start of each share, each
share planned alone in windows as its rank plans it, and the ranks kept in lock step as the loader keeps them
(:mod:`~lit_seqpack.data.streaming.loader`): every rank runs the steps of the rank with the most, a rank with fewer
runs empty fillers (:class:`LockStepPrefix`). When ``num_workers >= 2`` loader workers read lanes of a share
(:mod:`~lit_seqpack.data.streaming.lanes`), the share's prefix is :func:`share_sizes` samples from the start of each
lane, each lane planned alone (:func:`combined_shares` adds them up), as the workers plan them.

Where a restored Lightning fit loop resumes a stream, going back to the start of an interrupted optimizer step.

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

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from lit_seqpack.data._trainer import read_layout, training_start
from lit_seqpack.data.batching._samples import sample_loss_tokens
from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.indexed._resume import plan_settings
from lit_seqpack.data.settings import BatchingSettings
from lit_seqpack.data.sources.streams import StreamSource, describe_stream
from lit_seqpack.data.streaming.buffer import OverlongCounter, stream_windows
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.lanes import lane_count, lane_source
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.parallel import DataParallelLayout
from lit_seqpack.planning.plan import PlanConfig

__all__ = [
    "STREAM_STATE",
    "StreamPipeline",
    "LockStepPrefix",
    "SharePrefix",
    "combined_shares",
    "plan_share_prefix",
    "prefix_lengths",
    "share_sizes",
    "RestoredLoopRewind",
    "rewind_restored_loop",
]


STREAM_STATE = "stream_loader"
_LEGACY_WINDOW = "stream_buffer"  # the window's name in checkpoints written before it was one setting


class StreamPipeline:
    """A stream read in windows of ``settings.window`` samples, resumable mid-stream: each rank reads and plans its own
    share (``stream_split="rank"``, kept in lock step by the loader) or every rank reads it all and keeps its part of
    one plan for every rank (``"replicate"``).

    Args:
        settings: the batching settings.
        source: the stream.

    Raises:
        ValueError: a setting the streaming path cannot honour (held-out fractions, ``loss_weight_field``),
            naming it.
    """

    def __init__(self, settings: BatchingSettings, source: StreamSource) -> None:
        for name in ("val_fraction", "test_fraction"):
            if getattr(settings, name):
                raise ValueError(
                    f"{name}={getattr(settings, name)} cannot hold samples out of a stream (it has no index); set "
                    f"{name}=0 with a stream source, or pass val_source=... (an indexed source)"
                )
        if settings.loss_weight_field is not None:
            raise ValueError(
                f"loss_weight_field={settings.loss_weight_field!r} is not supported with a stream source yet "
                "(streamed batches would silently ignore it): set loss_weight_field=None, or use an indexed source"
            )
        self.settings, self.source = settings, source
        self.layout, self.context_parallel_rank = DataParallelLayout(), 0
        self.trainer: Any = None
        self.is_set_up = False
        self.overlong_report: OverlongReport | None = None
        self.eval_overlong_reports: dict[str, OverlongReport | None] = {}
        self._loader: StreamingDataLoader | None = None
        self._pending_state: dict[str, Any] | None = None
        self._rewind: RestoredLoopRewind | None = None

    # ------------------------------------------------------------------ data
    @property
    def vocab_size(self) -> int:
        """The vocabulary the stream declares (a stream is never scanned), at least ``pad_token_id + 1``."""
        value = getattr(self.source, "vocab_size", None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"the stream {type(self.source).__name__} has no vocab_size (a stream is never scanned): pass "
                "vocab_size= to the stream source, or set the model's vocab_size yourself"
            )
        return max(value, self.settings.pad_token_id + 1)

    def prepare(self) -> None:
        """Nothing to prepare: a stream is validated window by window as it is read."""

    def setup(self, trainer: Any, *, fabric: Any = None, accumulate_grad_batches: int = 1) -> None:
        """Read the layout from the Trainer (or Fabric)."""
        self.trainer = trainer
        self.layout, self.context_parallel_rank = read_layout(
            trainer, self.settings.parallel, fabric=fabric, accumulate_grad_batches=accumulate_grad_batches
        )
        self.is_set_up = True

    def facts(self) -> dict[str, Any]:
        """The facts every window plan depends on: a resume must keep all of them."""
        settings = self.settings
        config = settings.plan_config(self.layout)
        return {
            "world_size": self.layout.world_size,
            "accumulate_grad_batches": self.layout.accumulate_grad_batches,
            "mode": settings.mode,
            "max_tokens": settings.max_tokens,
            "overlong": settings.overlong,
            "truncation_side": settings.truncation_side,
            **plan_settings(config),
            "window": settings.stream_window,  # the stream's window, not the planner's (None: one buffer)
            "pad_to_multiple_of": settings.pad_to_multiple_of,
            # one rank reads the whole stream either way: the same windows, the same checkpoint
            "stream_split": settings.stream_split if self.layout.world_size > 1 else None,
        }

    def _counter(self) -> OverlongCounter | None:
        budget = self.settings.document_budget
        if budget is None:
            return None
        return OverlongCounter(
            policy=self.settings.overlong,
            max_tokens=budget,
            token_fields=tuple(self.settings.token_fields),
            truncation_side=self.settings.truncation_side,
        )

    # ------------------------------------------------------------------ loaders
    def train_loader(self) -> StreamingDataLoader:
        """The training loader of the stream for this layout, with a pending resume state applied."""
        settings, counter, layout = self.settings, self._counter(), self.layout
        source, config, rank, data_parallel = self.source, settings.plan_config(layout), layout.rank, None
        if settings.stream_split == "rank":  # this rank's share, planned for this rank alone
            source, data_parallel = self._share(), (layout.rank, layout.world_size)
            config, rank = settings.plan_config(layout._replace(world_size=1, rank=0)), 0
        dataset = StreamingDataset(
            source,
            config=config,
            rank=rank,
            window_size=settings.stream_window,
            collator=settings.collator(self.context_parallel_rank),
            overlong=settings.overlong,
            truncation_side=settings.truncation_side,
            document_budget=None if counter is None else counter.max_tokens,
            document_multiple=settings.planned_document_multiple,
            vocab_size=self._model_vocab(),
            check_samples=settings.content_check_samples,
            seed=settings.seed,
            token_fields=tuple(settings.token_fields),
            data_parallel=data_parallel,
        )
        loader = StreamingDataLoader(
            dataset,
            num_workers=settings.num_workers,
            start_source=self._training_start,
            report_to=lambda report: setattr(self, "overlong_report", report),
            on_batch=self._on_batch,
            loader_timeout=settings.loader_timeout,
        )
        if self._pending_state is not None:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        self._loader = loader
        return loader

    def _share(self, layout: DataParallelLayout | None = None) -> StreamSource:
        """The share of the stream that ``layout``'s rank reads (``stream_split="rank"``; default: this rank's);
        the whole stream on one rank.

        Raises:
            ValueError: on more than one rank, a stream without ``split(index, count)``, naming it.
        """
        world_size, rank = (layout or self.layout).world_size, (layout or self.layout).rank
        if world_size == 1:
            return self.source
        split = getattr(self.source, "split", None)
        if not callable(split):
            raise ValueError(
                f"stream_split='rank' reads a share of the stream on each of the {world_size} ranks, but "
                f"{describe_stream(self.source)} has no split(index, count): give it one "
                "(lit_seqpack.data.sources.SplittableStream) or set stream_split='replicate' (every rank reads it all)"
            )
        return split(rank, world_size)

    def eval_loader(self, split: str) -> list:
        """A stream has no held-out split: no validation loader; a test loader is refused."""
        if split == "test":
            raise ValueError(
                "a stream has no test split (it is never indexed): test on an indexed source with a second "
                "SeqPackDataModule passed to "
                "trainer.test"
            )
        return []

    def _training_start(self, epoch: int, start: int, saved: dict[str, Any] | None) -> tuple[int, int]:
        """Where the loader starts: the Trainer's epoch and batch counter during fit, else the loader's own position.

        Lightning fetches the first batch of a loader without a length as soon as it builds it, which a schedule
        reading ``trainer.estimated_stepping_batches`` does before the loop counters are restored from the
        checkpoint. The checkpoint's own record of the Trainer's counters (``resume_at``, written by
        :meth:`state_dict`) is then the truth, and the counters are moved back once restored
        (:class:`RestoredLoopRewind`). A checkpoint written inside a gradient-accumulation window
        (``OnExceptionCheckpoint``, a requeue) resumes at the start of its optimizer step, as in the indexed
        pipeline: it holds no partial gradient (:func:`rewind_restored_loop`).
        """
        trainer, accumulate = self.trainer, self.layout.accumulate_grad_batches
        self._rewind = None
        if not getattr(trainer, "training", False):
            return training_start(trainer, epoch, start, None, accumulate)
        if trainer.fit_loop.restarting:
            return rewind_restored_loop(trainer.fit_loop, saved, accumulate)
        if saved is not None and saved.get("resume_at") is not None:  # the counters are not restored yet
            epoch, position = int(saved["resume_at"][0]), int(saved["resume_at"][1])
            self._rewind = RestoredLoopRewind(position % accumulate) if position % accumulate else None
            return epoch, position - position % accumulate
        point = None if saved is None else (saved["epoch"], saved["yielded"])
        return training_start(trainer, epoch, start, point, accumulate)

    def _on_batch(self) -> None:
        """Move the restored loop back at the first batch it draws itself (see :meth:`_training_start`)."""
        rewind = self._rewind
        if rewind is not None and rewind.at_batch(self.trainer.fit_loop):
            self._rewind = None

    def _model_vocab(self) -> int | None:
        """The vocabulary of the Trainer's model (``None`` without one), after checking that it embeds the pad id."""
        from lit_seqpack.model.hf_load import model_vocab_size  # the model's side of the check, read at setup only

        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        vocab = None if model is None else model_vocab_size(model)
        if vocab is not None and self.settings.pad_token_id >= vocab:
            raise ValueError(f"pad_token_id={self.settings.pad_token_id} is outside the model's vocab_size={vocab}")
        return vocab

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The plan facts and the loader's position (no sample)."""
        state: dict[str, Any] = {"facts": self.facts()}
        if self._loader is not None:
            loader = state["loader"] = self._loader.state_dict()
            trainer = self.trainer
            if getattr(trainer, "training", False):  # where the Trainer's counters will resume (_training_start)
                epochs = trainer.fit_loop.epoch_progress.current
                epoch, position = epochs.processed, trainer.fit_loop.epoch_loop.batch_progress.current.processed
                # written in the epoch-end hooks (processed, not completed): Lightning resumes at the next epoch's start
                ended = epochs.processed > epochs.completed
                loader["resume_at"] = [loader["epoch"], 0] if loader["epoch"] > epoch or ended else [epoch, position]
        return {STREAM_STATE: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the facts of a checkpoint's stream state and restore (or queue) its loader position.

        Raises:
            ValueError: the checkpoint holds no stream state, or one planned with other facts.
        """
        state = state_dict.get(STREAM_STATE)
        if not isinstance(state, dict) or "facts" not in state:
            raise ValueError("the checkpoint holds no stream state: it was not written by a run with a stream source")
        saved, current = dict(state["facts"]), self.facts()
        if _LEGACY_WINDOW in saved:
            saved["window"] = saved.pop(_LEGACY_WINDOW)
        saved.setdefault("truncation_side", "right")  # written before there was a choice
        if "stream_split" not in saved:  # written before there was a choice: every rank read the whole stream
            saved["stream_split"] = "replicate" if saved.get("world_size", 1) > 1 else None
        changed = [f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in current if saved.get(k) != current[k]]
        world, now = saved.get("world_size", 1), current["world_size"]
        if world != now:  # stream_split is None on one rank: its change follows from the world size, not the user
            derived = saved.get("stream_split") is None or current["stream_split"] is None
            changed = [c for c in changed if not (derived and c.startswith("stream_split:"))]
            raise ValueError(
                f"cannot resume the stream on another world size ({'; '.join(changed)}): a stream's checkpoint "
                f"resumes on the world size that wrote it; run on {world} rank(s) (an epoch-boundary checkpoint of "
                "map-style data is what continues on another world size)"
            )
        if changed:
            raise ValueError(
                "cannot resume the stream exactly: the checkpoint's windows were planned with other settings "
                f"({'; '.join(changed)}); resume with the checkpoint's settings"
            )
        loader_state = state.get("loader")
        if loader_state and self._loader is not None:
            self._loader.load_state_dict(loader_state)
        else:
            self._pending_state = loader_state

    # ------------------------------------------------------------------ inspection
    def _prefix_readers(self, max_samples: int, layout: DataParallelLayout) -> list[list[Iterator[Mapping[str, Any]]]]:
        """The samples training reads first, one list of readers a rank: the stream's first ``max_samples``
        (replicated), else the first samples of each rank's share, and of each lane of it when loader workers read
        lanes (:mod:`~lit_seqpack.data.streaming.pipeline` says why)."""
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
            raise ValueError(f"max_samples must be an int >= 1 (the stream prefix to inspect), got {max_samples!r}")
        if self.settings.stream_split == "replicate":
            return [[itertools.islice(self.source.open(), max_samples)]]
        readers = []
        for rank, size in enumerate(share_sizes(max_samples, layout.world_size)):
            share = self._share(layout._replace(rank=rank))
            lanes = lane_count(share, self.settings.num_workers)
            if not lanes:
                readers.append([itertools.islice(share.open(), size)])
                continue
            sources = [lane_source(share, lane, lanes) for lane in range(lanes)]
            readers.append(
                [itertools.islice(s.open(), n) for s, n in zip(sources, share_sizes(size, lanes), strict=True)]
            )
        return readers

    def prefix(self, max_samples: int, layout: DataParallelLayout | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and loss tokens of the ``max_samples`` samples training on ``layout`` (default: one rank) reads
        first, under the over-long policy (:meth:`_prefix_readers`); ``lit-seqpack inspect`` plans them offline and
        :attr:`overlong_report` counts the policy over them.

        Raises:
            ValueError: ``max_samples`` is not an int >= 1, or the prefix holds no sample.
        """
        readers = self._prefix_readers(max_samples, layout or DataParallelLayout())
        lengths, loss, report = prefix_lengths(
            itertools.chain.from_iterable(itertools.chain(*readers)), self._counter()
        )
        if not lengths.size:
            raise ValueError(f"the stream's first {max_samples} samples hold no sample to plan")
        self.overlong_report = report if report is not None else self.overlong_report
        return lengths, loss

    def prefix_microbatches(self, max_samples: int, layout: DataParallelLayout) -> int:
        """Microbatches per rank that the streaming loader trains the prefix in (windows of ``window`` samples) under
        ``stream_split="replicate"``: one plan of each window for every rank."""
        whole = layout._replace(world_size=1, rank=0)  # every rank reads the whole stream
        (stream,) = self._plan_prefix(max_samples, whole, self.settings.plan_config(layout))
        return stream.microbatches

    def _plan_prefix(self, max_samples: int, layout: DataParallelLayout, config: PlanConfig) -> tuple[SharePrefix, ...]:
        """The prefix read on ``layout`` (:meth:`prefix`), each reader's samples planned in windows with ``config``
        (a rank's lanes planned apart and added up, as its loader workers plan them)."""
        settings = self.settings
        return tuple(
            combined_shares(
                [
                    plan_share_prefix(
                        samples,
                        config=config,
                        window_size=settings.stream_window,
                        counter=self._counter(),
                        document_multiple=settings.planned_document_multiple,
                    )
                    for samples in lanes
                ]
            )
            for lanes in self._prefix_readers(max_samples, layout)
        )

    def prefix_lock_step(self, max_samples: int, layout: DataParallelLayout) -> LockStepPrefix:
        """How the loaders of ``stream_split="rank"`` train the prefix (:meth:`prefix`): each rank's share planned
        alone in windows of ``window`` samples, every rank running the most steps of any rank."""
        config = self.settings.plan_config(layout._replace(world_size=1, rank=0))
        return LockStepPrefix(
            shares=self._plan_prefix(max_samples, layout, config),
            accumulate_grad_batches=layout.accumulate_grad_batches,
            max_tokens=int(self.settings.max_tokens),
        )


def share_sizes(max_samples: int, world_size: int) -> list[int]:
    """Samples read from the start of each rank's share for a prefix of ``max_samples`` (the first ranks one more).

    Example:
        >>> share_sizes(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(max_samples, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SharePrefix:
    """One rank's share of a prefix, planned in windows as that rank's loader plans it.

    Args:
        samples: the share's samples planned (after the over-long policy).
        steps: the optimizer steps of its windows.
        microbatches: its own microbatches (``steps x accumulate_grad_batches``).
        empty: its windows' empty microbatches (bins fewer than a step's slots).
        real_tokens: the planned tokens of its samples (packing: each document rounded up to ``pad_to_multiple_of``).
    """

    samples: int
    steps: int
    microbatches: int
    empty: int
    real_tokens: int


def combined_shares(parts: Sequence[SharePrefix]) -> SharePrefix:
    """One rank's share from its lanes' (each planned alone by its loader worker): every count added up.

    Example:
        >>> lane = SharePrefix(samples=9, steps=3, microbatches=6, empty=1, real_tokens=500)
        >>> combined_shares([lane, lane]).microbatches
        12
    """
    return SharePrefix(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(SharePrefix)})


@dataclass(frozen=True, kw_only=True, slots=True)
class LockStepPrefix:
    """The shares of a prefix trained in lock step: each rank runs the most steps of any rank.

    Args:
        shares: each rank's :class:`SharePrefix`, in rank order.
        accumulate_grad_batches: microbatches per rank per optimizer step.
        max_tokens: the budget of a microbatch (the efficiency's denominator).

    Example:
        >>> shares = [SharePrefix(samples=9, steps=3, microbatches=6, empty=1, real_tokens=500),
        ...           SharePrefix(samples=6, steps=2, microbatches=4, empty=0, real_tokens=380)]
        >>> prefix = LockStepPrefix(shares=tuple(shares), accumulate_grad_batches=2, max_tokens=100)
        >>> prefix.microbatches_per_rank, prefix.empty_per_rank, round(prefix.efficiency, 4)
        (6, [1, 2], 0.7333)
    """

    shares: tuple[SharePrefix, ...]
    accumulate_grad_batches: int
    max_tokens: int

    @property
    def microbatches_per_rank(self) -> int:
        """Microbatches every rank runs: the most steps of any share, each of ``accumulate_grad_batches``."""
        return max((share.steps for share in self.shares), default=0) * self.accumulate_grad_batches

    @property
    def empty_per_rank(self) -> list[int]:
        """Each rank's microbatches without a sample: its windows' empty ones and its lock-step fillers."""
        total = self.microbatches_per_rank
        return [share.empty + total - share.microbatches for share in self.shares]

    @property
    def efficiency(self) -> float:
        """``real tokens / (microbatches over all ranks x max_tokens)``: empty microbatches count as waste."""
        slots = self.microbatches_per_rank * len(self.shares) * self.max_tokens
        return sum(share.real_tokens for share in self.shares) / slots if slots else 0.0


def plan_share_prefix(
    samples: Iterator[Mapping[str, Any]],
    *,
    config: PlanConfig,
    window_size: int,
    counter: OverlongCounter | None,
    document_multiple: int,
) -> SharePrefix:
    """Plan one share's prefix in windows (``config`` plans one rank, as the loader of a rank's share does)."""
    steps = microbatches = empty = real = kept = 0
    for window in stream_windows(
        samples,
        config=config,
        window_size=window_size,
        epoch=0,
        counter=counter,
        document_multiple=document_multiple,
    ):
        stats = window.plan.stats
        steps += window.plan.num_steps
        microbatches += window.plan.microbatches_per_rank
        empty += stats.num_empty_microbatches
        real += stats.real_tokens
        kept += stats.num_samples
    return SharePrefix(samples=kept, steps=steps, microbatches=microbatches, empty=empty, real_tokens=real)


def prefix_lengths(
    samples: Iterable[Mapping[str, Any]], counter: OverlongCounter | None
) -> tuple[np.ndarray, np.ndarray, OverlongReport | None]:
    """Lengths and loss tokens of ``samples`` under the over-long policy (samples numbered in their order), and the
    policy's counts (``None`` without a ``counter``).

    Example:
        >>> counter = OverlongCounter(policy="drop", max_tokens=3)
        >>> lengths, loss, report = prefix_lengths([{"input_ids": [1, 2]}, {"input_ids": [1] * 5}], counter)
        >>> lengths.tolist(), loss.tolist(), report.num_dropped
        ([2], [1], 1)
    """
    lengths, loss = [], []
    for number, sample in enumerate(samples):
        for kept in [sample] if counter is None else counter.pieces(number, sample):
            lengths.append(len(kept["input_ids"]))
            loss.append(sample_loss_tokens(kept))
    report = None if counter is None else counter.report()
    return np.array(lengths, dtype=np.int64), np.array(loss, dtype=np.int64), report


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
