"""The bounded look-ahead buffer: a stream cut into windows of ``window_size`` samples, each planned on its own.

Every window is packed by the plan's algorithm (best fit decreasing by default) and planned for all ranks and the
accumulation at once (in packing mode as packed by :mod:`~lit_seqpack.data.streaming.buffer`: the least-full
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

How a stream window is packed: the least-full rows wait for the next window, the last window is spread evenly.

A window is packed once and planned as packed (:func:`~lit_seqpack.planning.plan.plan_packed`):

- :func:`carried_over`: every window but the last holds back the samples of its least-full bins (below
  :data:`CARRY_FILL` of ``max_tokens``, or needed to fill whole optimizer steps) for the next window, so every row
  trained before the stream's end is nearly full, whatever the window's boundaries;
- :func:`even_bins`: the last window has no next one, and its leftover tokens would make one half-empty row (a
  slow rank at that step). Its samples are spread over the same number of rows as evenly as they go, so each rank's
  last steps are all about equally full and ranks ending at different steps stay balanced.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lit_seqpack.data.batching._samples import token_arrays, window_loss_tokens
from lit_seqpack.data.batching.overlong import OverlongReport, check_truncation_side, cut_tokens
from lit_seqpack.planning._windows import window_seeds
from lit_seqpack.planning.algorithms import get_packer, pack_first, packing_algorithm
from lit_seqpack.planning.plan import Plan, PlanConfig, build_plan, plan_packed

__all__ = [
    "OverlongCounter",
    "StreamWindow",
    "stream_windows",
    "CARRY_FILL",
    "carried_over",
    "even_bins",
    "packer_seed",
]


CARRY_FILL = 0.97
"""Bins filled below this share of the budget are carried into the next window (packing, not the last window)."""
_NONE = np.zeros(0, dtype=np.int64)


def carried_over(
    planned: np.ndarray, eligible: np.ndarray, config: PlanConfig, limit: int, *, seed: int = 0
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Pack a window and pick the samples to hold back for the next one: those of its least-full bins.

    The window is packed once (:func:`~lit_seqpack.planning.algorithms.pack_first`): the samples carried into it
    first (each sample waits one window at most, so they train now), then the others, so the least-full bins hold
    samples that may wait. Bins below :data:`CARRY_FILL` of the budget are carried, least full first; then, while
    the bins left do not fill whole optimizer steps (``world_size x accumulation``), the full bins of fewest samples
    (else the planner would split a bin in two half-empty ones). At most ``limit`` samples are carried, so the
    buffer never grows, and at least one bin is kept.

    Args:
        planned: the planned length of each sample of the window.
        eligible: ``False`` for samples carried into this window.
        config: the window's plan configuration (packing).
        limit: the most samples carried.
        seed: the packer's seed (``first_fit_shuffle``; :func:`packer_seed`).

    Returns:
        ``(held, (flat, ends))``: the positions (in the window) of the carried samples, sorted, and the bins kept
        (bin ``b`` is ``flat[ends[b - 1]:ends[b]]``, positions in the window without the carried samples).

    Example:
        >>> config = PlanConfig(mode="packing", max_tokens=10, shuffle=False)
        >>> held, (flat, ends) = carried_over(np.array([10, 7, 3, 2]), np.ones(4, dtype=bool), config, limit=2)
        >>> held.tolist(), flat.tolist(), ends.tolist()  # bins 10, 7+3, 2: the 2 waits
        ([3], [0, 1, 2], [1, 3])
        >>> pinned = np.array([True, True, True, False])  # the 2 was carried in: packed first, the 3 waits
        >>> carried_over(np.array([10, 7, 3, 2]), pinned, config, limit=2)[0].tolist()  # bins 2+7, 10, 3
        [2]
    """
    capacity = int(config.max_tokens)
    flat, ends = pack_first(planned, ~eligible, config.algorithm, capacity, seed=seed)
    starts = ends - np.diff(ends, prepend=0)
    fills = np.add.reduceat(planned[flat], starts) if ends.size else np.zeros(0, dtype=np.int64)
    movable = np.logical_and.reduceat(eligible[flat], starts) if ends.size else np.zeros(0, dtype=bool)
    sizes = ends - starts
    carried = np.zeros(ends.size, dtype=bool)

    def carry(b: int) -> bool:
        if not movable[b] or carried.sum() + 1 >= ends.size or sizes[carried].sum() + sizes[b] > limit:
            return False
        carried[b] = True
        movable[b] = False
        return True

    for b in np.argsort(fills, kind="stable"):
        if fills[b] >= CARRY_FILL * capacity or not carry(int(b)):
            break
    for b in np.argsort(sizes, kind="stable"):  # whole steps: carry the full bins of fewest samples
        if (ends.size - int(carried.sum())) % config.slots_per_step == 0:
            break
        carry(int(b))
    held = np.sort(np.concatenate([flat[starts[b] : ends[b]] for b in np.flatnonzero(carried)] or [_NONE]))
    keep = np.ones(planned.size, dtype=bool)
    keep[held] = False
    renumbered = np.cumsum(keep) - 1  # a kept sample's position among the kept ones
    kept_flat = np.concatenate([renumbered[flat[starts[b] : ends[b]]] for b in np.flatnonzero(~carried)] or [_NONE])
    return held, (kept_flat, np.cumsum(sizes[~carried]))


def packer_seed(config: PlanConfig, epoch: int) -> int:
    """The packer seed :func:`~lit_seqpack.planning.plan.build_plan` gives a window planned alone (a stream's)."""
    return int(window_seeds(config, epoch, 0).generate_state(1)[0])


def even_bins(planned: np.ndarray, config: PlanConfig, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """The last window's samples over as many bins as the planner would make, as evenly as they go.

    The bin count is the packer's own, rounded up to whole optimizer steps; the samples are dealt longest first,
    each to the least-full bin (ties: the lower bin), so the first ``count`` samples open one bin each. ``None`` when
    that would overfill a bin (very long samples): the window is then planned as usual.

    Args:
        planned: the planned length of each sample of the window.
        config: the window's plan configuration (packing).
        seed: the packer's seed (``first_fit_shuffle``; :func:`packer_seed`).

    Returns:
        ``(flat, ends)`` (bin ``b`` is ``flat[ends[b - 1]:ends[b]]``), or ``None``.

    Example:
        >>> config = PlanConfig(mode="packing", max_tokens=10, shuffle=False)
        >>> flat, ends = even_bins(np.array([9, 8, 2, 1]), config)  # best fit: 9+1, 8+2; evenly: the same
        >>> flat.tolist(), ends.tolist()
        ([0, 3, 1, 2], [2, 4])
        >>> flat, ends = even_bins(np.array([6, 5, 4, 1, 1, 1]), config)  # best fit: 6+4, 5+1+1+1 (10 and 8)
        >>> [[int(i) for i in flat[a:b]] for a, b in zip([0, *ends[:-1]], ends)]  # evenly: 9 and 9
        [[0, 3, 4, 5], [1, 2]]
    """
    capacity, multiple = int(config.max_tokens), config.slots_per_step
    packer = get_packer(packing_algorithm(config.algorithm).name, capacity, seed=seed)
    count = -(-packer.count_bins(planned) // multiple) * multiple
    if count < 1 or count > planned.size:
        return None
    order = np.argsort(-planned, kind="stable")
    heap = [(0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in order.tolist():
        fill, b = heapq.heappop(heap)
        fill += int(planned[i])
        if fill > capacity:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (fill, b))
    return np.fromiter((i for members in bins for i in members), np.int64, planned.size), np.cumsum(
        [len(members) for members in bins]
    )


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
        relocated = getattr(sample, "relocated", None)  # keep where the sample comes from (streaming/dataset.py)
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
    next window instead of being trained in half-empty rows (:func:`carried_over`); the last window
    carries nothing and is spread evenly over its rows (:func:`even_bins`).

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
