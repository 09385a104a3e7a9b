"""The bounded look-ahead buffer: a stream cut into windows of ``buffer_size`` samples, each planned on its own.

Every window is planned by the offline planner (:func:`~lit_seqpack.planning.plan.build_plan`, best fit decreasing
by default) for all ranks and the accumulation at once, so:

- memory holds one window of samples (plus the reader's own, e.g. one Parquet row group);
- every optimizer step's microbatches come from one window, so its loss-token total over all ranks
  (``step_loss_tokens``, the exact-loss normaliser) is known before the step starts, without a collective;
- every rank gets the same number of microbatches per window (the plan adds empty lock-step fillers when a short
  last window has fewer bins than ranks x accumulation), so ranks stay in lock step to the end of the stream;
- every sample of the window is in exactly one microbatch of one rank.

The over-long policy is applied sample by sample as the stream is read and counted in a
:class:`OverlongCounter` (the same :class:`~lit_seqpack.data.overlong.OverlongReport` as the map-style path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lit_seqpack.data.lengths import sample_loss_tokens
from lit_seqpack.data.overlong import OverlongReport
from lit_seqpack.planning.plan import Plan, PlanConfig, build_plan

__all__ = ["OverlongCounter", "StreamWindow", "stream_windows"]

_SHOWN = 5
_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


@dataclasses.dataclass(kw_only=True, slots=True)
class OverlongCounter:
    """Running counts of the over-long policy over a stream (samples are numbered from the stream's start).

    Args:
        policy: ``"error"``, ``"truncate"`` or ``"drop"``.
        max_tokens: the longest document allowed.
    """

    policy: str
    max_tokens: int
    num_samples: int = 0
    num_overlong: int = 0
    tokens_cut: int = 0
    shown: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def admit(self, number: int, sample: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The sample under the policy (``None``: dropped); raises under ``"error"`` for an over-long sample."""
        length = len(sample["input_ids"])
        if length == 0:
            raise ValueError(f"sample {number} of the stream has no token: input_ids must hold at least one token")
        self.num_samples += 1
        if length <= self.max_tokens:
            return sample
        if self.policy == "error":
            raise ValueError(
                f"sample {number} of the stream has {length} tokens, more than max_tokens={self.max_tokens}; "
                "raise max_tokens, or set overlong='truncate' or overlong='drop'"
            )
        self.num_overlong += 1
        if len(self.shown) < _SHOWN:
            self.shown.append((number, length))
        if self.policy == "drop":
            self.tokens_cut += length
            return None
        self.tokens_cut += length - self.max_tokens
        return {k: v[: self.max_tokens] if k in _TOKEN_KEYS else v for k, v in sample.items()}

    def state(self) -> dict[str, Any]:
        """The counts as a small dict (a checkpoint keeps the counts at the start of the window it resumes in)."""
        return {
            "num_samples": self.num_samples,
            "num_overlong": self.num_overlong,
            "tokens_cut": self.tokens_cut,
            "shown": [list(item) for item in self.shown],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from counts saved by :meth:`state`."""
        self.num_samples, self.num_overlong = int(state["num_samples"]), int(state["num_overlong"])
        self.tokens_cut = int(state["tokens_cut"])
        self.shown = [(int(i), int(n)) for i, n in state["shown"]]

    def report(self) -> OverlongReport:
        """The counts so far as an :class:`~lit_seqpack.data.overlong.OverlongReport`."""
        dropped = self.policy == "drop"
        return OverlongReport(
            policy=self.policy,
            max_tokens=self.max_tokens,
            num_samples=self.num_samples,
            num_overlong=self.num_overlong,
            num_dropped=self.num_overlong if dropped else 0,
            num_truncated=0 if dropped else self.num_overlong,
            tokens_dropped=self.tokens_cut if dropped else 0,
            tokens_truncated=0 if dropped else self.tokens_cut,
            indices=tuple(i for i, _ in self.shown),
            lengths=tuple(n for _, n in self.shown),
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StreamWindow:
    """One planned window of the stream.

    Args:
        index: the window's number in the epoch (0-based).
        start: the stream position of its first sample (reopening there re-reads the window).
        first_sample: the stream number of its first sample.
        first_microbatch: each rank's microbatches before this window in the epoch (the same on every rank).
        first_step: optimizer steps before this window in the epoch.
        samples: the window's samples after the over-long policy (plan indices point into it).
        loss_tokens: the loss tokens of each of those samples.
        plan: the window's plan for every rank.
        overlong_before: the over-long counts of the stream before this window (:meth:`OverlongCounter.state`).
        overlong_after: the counts up to the end of this window.
    """

    index: int
    start: Any
    first_sample: int
    first_microbatch: int
    first_step: int
    samples: list[Mapping[str, Any]]
    loss_tokens: np.ndarray
    plan: Plan
    overlong_before: dict[str, Any] | None = None
    overlong_after: dict[str, Any] | None = None


def _round_up(lengths: np.ndarray, multiple: int) -> np.ndarray:
    return lengths if multiple == 1 else (lengths + multiple - 1) // multiple * multiple


def stream_windows(
    reader: Iterator[Mapping[str, Any]],
    *,
    config: PlanConfig,
    buffer_size: int,
    epoch: int,
    counter: OverlongCounter | None = None,
    document_multiple: int = 1,
    start: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> Iterator[StreamWindow]:
    """Read ``reader`` into windows of ``buffer_size`` samples and plan each one.

    Args:
        reader: a :class:`~lit_seqpack.data.streaming.sources.StreamReader` (its ``position`` is read at each
            window start).
        config: the plan of a window (``window`` and ``shuffle`` as given: shuffling reorders inside the window).
        buffer_size: samples read ahead and planned together (>= 1).
        epoch: seeds the window plans (with the window's number).
        counter: applies and counts the over-long policy (``None``: samples must fit ``config.max_tokens``).
        document_multiple: packed documents are padded to a multiple of this (planned on the padded lengths).
        start: ``(window, sample, microbatch, step)`` numbers of the first window (a resume).

    Example:
        >>> from lit_seqpack.data.streaming.sources import GeneratorStream
        >>> stream = GeneratorStream(lambda: ({"input_ids": [1] * n} for n in (5, 3, 4, 4, 2)))
        >>> config = PlanConfig(mode="packing", max_tokens=8, shuffle=False)
        >>> [w.plan.rank_microbatches(0) for w in stream_windows(stream.open(), config=config, buffer_size=3, epoch=0)]
        [[[0, 1], [2]], [[0, 1]]]
    """
    window, number, microbatch, step = start
    while True:
        position = getattr(reader, "position", None)
        before = None if counter is None else counter.state()
        first = number
        samples: list[Mapping[str, Any]] = []
        for sample in reader:
            kept = sample if counter is None else counter.admit(number, sample)
            number += 1
            if kept is not None:
                samples.append(kept)
            if number - first == buffer_size:
                break
        if number == first:
            return
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
        loss = np.array([sample_loss_tokens(s) for s in samples], dtype=np.int64)
        planned = _round_up(lengths, document_multiple) if config.mode == "packing" else lengths
        plan = build_plan(planned, config, epoch=epoch, loss_tokens=loss) if samples else _empty_plan(config, epoch)
        yield StreamWindow(
            index=window,
            start=position,
            first_sample=first,
            first_microbatch=microbatch,
            first_step=step,
            samples=samples,
            loss_tokens=loss,
            plan=plan,
            overlong_before=before,
            overlong_after=None if counter is None else counter.state(),
        )
        window, microbatch, step = window + 1, microbatch + plan.microbatches_per_rank, step + plan.num_steps


def _empty_plan(config: PlanConfig, epoch: int) -> Plan:
    """The plan of a window whose every sample was dropped: no step, no microbatch."""
    return build_plan(np.zeros(0, dtype=np.int64), config, epoch=epoch)
