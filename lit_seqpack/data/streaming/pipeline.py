"""``StreamPipeline``: a stream source under the batching settings, as a loader, a checkpoint state and a prefix.

The DataModule builds it for a :class:`~lit_seqpack.data.sources.streams.StreamSource` and delegates every hook to
it. A resume must keep every fact the window plans depend on (:meth:`StreamPipeline.facts`); a different one is
refused with a message naming it, since re-planned windows would train other microbatches than the checkpointed
run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lit_seqpack.data._trainer import read_layout, training_start
from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.indexed._resume import plan_settings
from lit_seqpack.data.settings import BatchingSettings
from lit_seqpack.data.sources.streams import StreamSource, describe_stream
from lit_seqpack.data.streaming.buffer import OverlongCounter
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.lanes import lane_count, lane_source
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.data.streaming.prefix import (
    LockStepPrefix,
    SharePrefix,
    combined_shares,
    plan_share_prefix,
    prefix_lengths,
    share_sizes,
)
from lit_seqpack.data.streaming.resume import RestoredLoopRewind, rewind_restored_loop
from lit_seqpack.parallel import DataParallelLayout
from lit_seqpack.planning.plan import PlanConfig

__all__ = ["STREAM_STATE", "StreamPipeline"]

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
            policy=self.settings.overlong, max_tokens=budget, token_fields=tuple(self.settings.token_fields)
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
        from lit_seqpack.model.vocab import model_vocab_size  # the model's side of the check, read at setup only

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
        lanes (:mod:`~lit_seqpack.data.streaming.prefix` says why)."""
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
