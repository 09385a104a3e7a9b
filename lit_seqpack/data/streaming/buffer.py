"""The bounded look-ahead buffer: a stream cut into windows of ``window_size`` samples, each planned on its own.

Every window is packed by the plan's algorithm (best fit decreasing by default) and planned for all ranks and the
accumulation at once (in packing mode as packed by :mod:`~lit_seqpack.data.streaming.window_packing`: the least-full
rows wait for the next window, the last window is spread evenly; other modes by
:func:`~lit_seqpack.planning.plan.build_plan`), so:

- memory holds one window of samples, up to half a window read ahead in packing mode (a stream ending there
  joins the window), and the reader's own (e.g. one Parquet row group);
- every optimizer step's microbatches come from one window, so its loss-token total over all ranks
  (``step_loss_tokens``, the exact-loss normaliser) is known before the step starts, without a collective;
- every rank gets the same number of microbatches per window (the plan adds empty lock-step fillers when a short
  last window has fewer bins than ranks x accumulation), so ranks stay in lock step to the end of the stream;
- every sample of the window is in exactly one microbatch of one rank.

The over-long policy is applied sample by sample as the stream is read and counted in a
:class:`OverlongCounter` (the same :class:`~lit_seqpack.data.batching.overlong.OverlongReport` as the map-style path);
under ``overlong="split"`` a sample's pieces enter the window together, as samples of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lit_seqpack.data.batching._samples import token_arrays, window_loss_tokens
from lit_seqpack.data.batching.overlong import OverlongReport, check_truncation_side, cut_tokens
from lit_seqpack.data.streaming.window_packing import carried_over, even_bins, packer_seed
from lit_seqpack.planning.plan import Plan, PlanConfig, build_plan, plan_packed

__all__ = ["OverlongCounter", "StreamWindow", "stream_windows"]

_SHOWN = 5
_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


@dataclasses.dataclass(kw_only=True, slots=True)
class OverlongCounter:
    """Running counts of the over-long policy over a stream (samples are numbered from the stream's start).

    Args:
        policy: ``"error"``, ``"truncate"``, ``"drop"`` or ``"split"``.
        max_tokens: the longest document allowed.
        token_fields: the declared per-token fields (:mod:`lit_seqpack.data.batching.fields`), cut with the tokens under
            ``"truncate"`` and ``"split"``; each must be as long as ``input_ids`` before the cut (a longer one would
            otherwise be cut to the same length and misalign silently).
        truncation_side: the end ``"truncate"`` cuts: ``"right"`` keeps the first tokens, ``"left"`` the last ones.
    """

    policy: str
    max_tokens: int
    token_fields: tuple[str, ...] = ()
    truncation_side: str = "right"
    num_samples: int = 0
    num_overlong: int = 0
    tokens_cut: int = 0
    num_pieces: int = 0
    shown: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        check_truncation_side(self.truncation_side, self.policy)

    def admit(self, number: int, sample: Mapping[str, Any], name: object = None) -> Mapping[str, Any] | None:
        """The sample under the policy (``None``: dropped); raises under ``"error"`` for an over-long sample.

        Under ``"split"`` use :meth:`pieces` (a sample may become several).

        Args:
            number: the sample's number in the stream (what the report lists).
            sample: the sample read.
            name: what an error calls the sample (default ``sample <number> of the stream``).
        """
        if self.policy == "split":
            raise ValueError("overlong='split' may cut a sample into several: read them with OverlongCounter.pieces")
        kept = self.pieces(number, sample, name)
        return kept[0] if kept else None

    def pieces(self, number: int, sample: Mapping[str, Any], name: object = None) -> list[Mapping[str, Any]]:
        """What the policy makes of the sample: ``[]`` (dropped), the sample itself or cut, or its pieces (``"split"``,
        in order, each of at most ``max_tokens`` tokens); raises under ``"error"`` for an over-long sample.

        Args:
            number: the sample's number in the stream (what the report lists).
            sample: the sample read.
            name: what an error calls the sample (default ``sample <number> of the stream``).
        """
        length = len(sample["input_ids"])
        if name is None:
            name = f"sample {number} of the stream"
        if length == 0:
            raise ValueError(f"{name} has no token: input_ids must hold at least one token")
        self.num_samples += 1
        if length <= self.max_tokens:
            return [sample]
        if self.policy == "error":
            raise ValueError(
                f"{name} has {length} tokens, more than max_tokens={self.max_tokens}; raise max_tokens, or set "
                "overlong='split' (every token kept, in pieces), overlong='truncate' or overlong='drop'"
            )
        self.num_overlong += 1
        if len(self.shown) < _SHOWN:
            self.shown.append((number, length))
        if self.policy == "drop":
            self.tokens_cut += length
            return []
        budget = self.max_tokens
        if self.policy == "split":
            why = f"overlong='split' cuts both into pieces of max_tokens={budget}"
            starts = range(0, length, budget)
            self.num_pieces += len(starts)
        else:
            why = f"overlong='truncate' cuts both to max_tokens={budget}"
            starts = range(length - budget if self.truncation_side == "left" else 0, length, length)
            self.tokens_cut += length - budget
        relocated = getattr(sample, "relocated", None)  # keep where the sample comes from (streaming/_where.py)
        kept = []
        for start in starts:
            cut = cut_tokens(sample, start, start + budget, token_fields=self.token_fields, name=name, why=why)
            kept.append(cut if relocated is None else relocated(cut))
        return kept

    def state(self) -> dict[str, Any]:
        """The counts as a small dict (a checkpoint keeps the counts at the start of the window it resumes in)."""
        return {
            "num_samples": self.num_samples,
            "num_overlong": self.num_overlong,
            "tokens_cut": self.tokens_cut,
            "num_pieces": self.num_pieces,
            "shown": [list(item) for item in self.shown],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from counts saved by :meth:`state`."""
        self.num_samples, self.num_overlong = int(state["num_samples"]), int(state["num_overlong"])
        self.tokens_cut = int(state["tokens_cut"])
        self.num_pieces = int(state.get("num_pieces", 0))  # written before overlong="split" had none
        self.shown = [(int(i), int(n)) for i, n in state["shown"]]

    def report(self) -> OverlongReport:
        """The counts so far as an :class:`~lit_seqpack.data.batching.overlong.OverlongReport`."""
        counted = {"drop": "num_dropped", "truncate": "num_truncated", "split": "num_split"}.get(self.policy)
        cut = {"drop": "tokens_dropped", "truncate": "tokens_truncated"}.get(self.policy)
        return OverlongReport(
            policy=self.policy,
            max_tokens=self.max_tokens,
            num_samples=self.num_samples,
            num_overlong=self.num_overlong,
            num_pieces=self.num_pieces,
            truncation_side=self.truncation_side,
            indices=tuple(i for i, _ in self.shown),
            lengths=tuple(n for _, n in self.shown),
            **({counted: self.num_overlong} if counted else {}),
            **({cut: self.tokens_cut} if cut else {}),
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
        samples: the window's planned samples after the over-long policy (plan indices point into it); those carried
            in from the previous window come first, those carried on to the next are not here.
        carried_in: the samples carried into this window from the previous one (a resume re-reads the window from
            ``start`` and needs these too).
        loss_tokens: the loss tokens of each of those samples.
        plan: the window's plan for every rank.
        overlong_before: the over-long counts of the stream before this window (:meth:`OverlongCounter.state`).
        overlong_after: the counts up to the end of this window.
        samples_read: the stream samples read up to the end of this window (what a rank compares at the stream's end).
    """

    index: int
    start: Any
    first_sample: int
    first_microbatch: int
    first_step: int
    samples: list[Mapping[str, Any]]
    carried_in: list[Mapping[str, Any]]
    loss_tokens: np.ndarray
    plan: Plan
    overlong_before: dict[str, Any] | None = None
    overlong_after: dict[str, Any] | None = None
    samples_read: int = 0


def _round_up(lengths: np.ndarray, multiple: int) -> np.ndarray:
    return lengths if multiple == 1 else (lengths + multiple - 1) // multiple * multiple


def stream_windows(
    reader: Iterator[Mapping[str, Any]],
    *,
    config: PlanConfig,
    window_size: int,
    epoch: int,
    counter: OverlongCounter | None = None,
    document_multiple: int = 1,
    start: tuple[int, int, int, int] = (0, 0, 0, 0),
    carried: list[Mapping[str, Any]] | None = None,
) -> Iterator[StreamWindow]:
    """Read ``reader`` into windows of ``window_size`` samples and plan each one.

    In packing mode the samples of a window's least-full bins (at most a third of the buffer) are carried into the
    next window instead of being trained in half-empty rows (:func:`~.window_packing.carried_over`); the last window
    carries nothing and is spread evenly over its rows (:func:`~.window_packing.even_bins`).

    Args:
        reader: a :class:`~lit_seqpack.data.sources.streams.StreamReader` (its ``position`` is read at each
            window start).
        config: the plan of a window (``window`` and ``shuffle`` as given: shuffling reorders inside the window).
        window_size: samples held and planned together (>= 1), carried ones included. In packing mode up to half
            as many are read ahead: when the stream ends among them, they join the window (its last).
        epoch: seeds the window plans.
        counter: applies and counts the over-long policy (``None``: samples must fit ``config.max_tokens``).
        document_multiple: packed documents are padded to a multiple of this (planned on the padded lengths).
        start: ``(window, sample, microbatch, step)`` numbers of the first window (a resume).
        carried: samples carried into the first window (a resume: the window record's ``carried``).

    Example:
        >>> from lit_seqpack.data.sources.streams import GeneratorStream
        >>> stream = GeneratorStream(lambda: ({"input_ids": [1] * n} for n in (5, 3, 4, 4, 2)))
        >>> config = PlanConfig(mode="packing", max_tokens=8, shuffle=False)
        >>> windows = list(stream_windows(stream.open(), config=config, window_size=3, epoch=0))
        >>> [[len(w.carried_in), w.plan.rank_microbatches(0)] for w in windows]  # 5+3; the 4 waits; 4, 4 and 2 evenly
        [[0, [[0, 1]]], [1, [[0, 2], [1]]]]
    """
    window, number, microbatch, step = start
    carried = list(carried or [])
    packing = config.mode == "packing"
    limit, ahead = (window_size // 3, window_size // 2) if packing else (0, 0)
    seed = packer_seed(config, epoch)
    pending: list[Mapping[str, Any]] = []  # read ahead for the next window
    mark = (getattr(reader, "position", None), number, None if counter is None else counter.state())
    last = getattr(reader, "last", None)

    def read(into: list[Mapping[str, Any]], size: int) -> bool:
        """Read into ``into`` until it holds ``size`` samples; ``False`` when the stream ends first."""
        nonlocal number
        while len(into) < size:
            sample = next(reader, None)
            if sample is None:
                return False
            name = f"sample {number} of the stream" if last is None else last  # a LocatedReader names its file
            sample = token_arrays(sample, name)  # converted once, not at every use
            number += 1
            if counter is None:
                into.append(sample)
            else:  # dropped, kept, cut, or split into pieces that enter the window together
                into.extend(counter.pieces(number - 1, sample, name))
        return True

    while True:
        position, first, before = mark  # where this window's fresh samples start (read ahead or not)
        carried_in, samples, pending = carried, [*carried, *pending], []
        ended = not read(samples, window_size)
        mark = (getattr(reader, "position", None), number, None if counter is None else counter.state())
        if not ended and ahead:  # a short last part joins this window (no half-empty last window on its own)
            ended = not read(pending, ahead)
            if ended:
                samples, pending = samples + pending, []
        after = mark if not ended else (None, number, None if counter is None else counter.state())
        if number == first and not samples:
            return
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
        planned = _round_up(lengths, document_multiple) if config.mode == "packing" else lengths
        carried, bins = [], None
        if ended and config.mode == "packing" and len(samples) > 1:
            bins = even_bins(planned, config, seed=seed)
        elif not ended and limit and len(samples) > 1:
            eligible = np.arange(len(samples)) >= len(carried_in)
            held, bins = carried_over(planned, eligible, config, limit, seed=seed)
            carried = [samples[i] for i in held]
            keep = np.ones(len(samples), dtype=bool)
            keep[held] = False
            samples, planned = [s for s, k in zip(samples, keep, strict=True) if k], planned[keep]
        loss = window_loss_tokens(samples)
        if bins is not None:  # planned as packed: a second packing could make other bins
            plan = plan_packed(planned, bins, config, epoch=epoch, loss_tokens=loss)
        else:
            plan = build_plan(planned, config, epoch=epoch, loss_tokens=loss) if samples else _empty_plan(config, epoch)
        yield StreamWindow(
            index=window,
            start=position,
            first_sample=first,
            first_microbatch=microbatch,
            first_step=step,
            samples=samples,
            carried_in=carried_in,
            loss_tokens=loss,
            plan=plan,
            overlong_before=before,
            overlong_after=after[2],
            samples_read=after[1],
        )
        window, microbatch, step = window + 1, microbatch + plan.microbatches_per_rank, step + plan.num_steps
        if ended:
            return


def _empty_plan(config: PlanConfig, epoch: int) -> Plan:
    """The plan of a window whose every sample was dropped: no step, no microbatch."""
    return build_plan(np.zeros(0, dtype=np.int64), config, epoch=epoch)
