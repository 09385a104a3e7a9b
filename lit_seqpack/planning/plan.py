"""The global plan: for every rank, the microbatches (dataset indices) of every optimizer step of an epoch.

``build_plan`` is a pure function of the lengths, the :class:`PlanConfig` and the epoch. Every rank
computes the same plan and reads its own column; nothing is communicated::

    epoch order   shuffle(seed, epoch) -> windows of `window` samples (window i trains before i+1)
    per window    packing: packer bins | dynamic: sort + token-budget groups | padded: fixed batches
                  -> G microbatches, G a multiple of world_size x accumulate_grad_batches
                     (bins split, or empty fillers when there are fewer samples than slots)
                  -> (step, rank, slot) grid with even rank loads per step (see ``_balance``)
    result        step 0: rank 0 [mb, mb]  rank 1 [mb, mb]     step_loss_tokens[0]
                  step 1: rank 0 [mb, mb]  rank 1 [mb, mb]     step_loss_tokens[1]   ...

Every index appears exactly once per epoch, every rank gets the same number of microbatches per step,
and each microbatch carries the loss-token total of its step over all ranks (exact normalisation
without an all-reduce).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lit_seqpack._checks import check_int
from lit_seqpack.planning._order import WindowOrder, auto_window
from lit_seqpack.planning._windows import WindowPlan, as_counts, check_budget, plan_window, slot_window, window_seeds
from lit_seqpack.planning.algorithms import split_fullest_flat
from lit_seqpack.planning.balance import step_imbalance
from lit_seqpack.planning.config import MICROBATCH_ORDERS, MODES, PlanConfig

__all__ = [
    "MICROBATCH_ORDERS",
    "MODES",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "PlannedMicrobatch",
    "as_counts",
    "build_plan",
    "plan_packed",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanStats:
    """Figures of one epoch's plan.

    Args:
        num_samples: samples planned.
        num_steps: optimizer steps.
        num_microbatches: microbatches over all ranks, empty fillers included.
        num_empty_microbatches: lock-step fillers (no sample; the collator makes zero-weight dummies).
        real_tokens: tokens of the samples.
        computed_tokens: tokens after padding (packing: rows rounded up; dynamic/padded: ``rows x Lp``).
        padding_ratio: ``1 - real_tokens / computed_tokens``.
        utilization: ``real_tokens / (num_microbatches x budget)`` with budget ``max_tokens`` (padded:
            the largest microbatch); the packing efficiency, fillers counted as waste.
        imbalance_mean: mean over steps of max/mean of the real tokens of each rank in the step.
        imbalance_max: the worst step's max/mean.
    """

    num_samples: int
    num_steps: int
    num_microbatches: int
    num_empty_microbatches: int
    real_tokens: int
    computed_tokens: int
    padding_ratio: float
    utilization: float
    imbalance_mean: float
    imbalance_max: float


class PlannedMicrobatch(NamedTuple):
    """One rank's microbatch: dataset indices, its optimizer step, that step's loss tokens over all ranks."""

    indices: list[int]
    step: int
    step_loss_tokens: int


class Plan:
    """One epoch's plan; built by :func:`build_plan`, read-only.

    Args:
        config: the configuration it was built with.
        epoch: the epoch it was built for.
        members: dataset indices of all microbatches, concatenated.
        bounds: microbatch ``m`` holds ``members[bounds[m]:bounds[m + 1]]``.
        slots: ``[num_steps, world_size, accumulate_grad_batches]`` microbatch ids.
        step_loss_tokens: loss tokens of each step over all ranks.
        stats: the plan's :class:`PlanStats`.
    """

    __slots__ = ("_bounds", "_members", "_slots", "_step_loss_tokens", "config", "epoch", "stats")

    def __init__(
        self,
        *,
        config: PlanConfig,
        epoch: int,
        members: np.ndarray,
        bounds: np.ndarray,
        slots: np.ndarray,
        step_loss_tokens: np.ndarray,
        stats: PlanStats,
    ) -> None:
        self.config, self.epoch, self.stats = config, epoch, stats
        self._members, self._bounds, self._slots, self._step_loss_tokens = members, bounds, slots, step_loss_tokens
        for array in (members, bounds, slots, step_loss_tokens):
            array.flags.writeable = False

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the epoch."""
        return int(self._slots.shape[0])

    @property
    def microbatches_per_rank(self) -> int:
        """Microbatches each rank runs this epoch (the same on every rank)."""
        return self.num_steps * self.config.accumulate_grad_batches

    @property
    def step_loss_tokens(self) -> np.ndarray:
        """Loss tokens of every optimizer step summed over all ranks (read-only ``int64`` array)."""
        return self._step_loss_tokens

    def microbatch(self, rank: int, position: int) -> PlannedMicrobatch:
        """The ``position``-th microbatch (0-based, in training order) of ``rank``."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be in [0, {self.config.world_size}), got {rank}")
        if not 0 <= position < self.microbatches_per_rank:
            raise IndexError(f"position {position} out of range for {self.microbatches_per_rank} microbatches")
        step, slot = divmod(position, self.config.accumulate_grad_batches)
        m = int(self._slots[step, rank, slot])
        indices = self._members[self._bounds[m] : self._bounds[m + 1]].tolist()
        return PlannedMicrobatch(indices, step, int(self._step_loss_tokens[step]))

    def rank_microbatches(self, rank: int) -> list[list[int]]:
        """All microbatches of ``rank`` in training order (``accumulate_grad_batches`` per step)."""
        return [self.microbatch(rank, p).indices for p in range(self.microbatches_per_rank)]

    def step_microbatches(self, step: int) -> list[list[list[int]]]:
        """The microbatches of optimizer step ``step``, as ``[rank][slot] -> indices``."""
        accumulate = self.config.accumulate_grad_batches
        return [
            [self.microbatch(rank, step * accumulate + j).indices for j in range(accumulate)]
            for rank in range(self.config.world_size)
        ]

    def fingerprint(self) -> str:
        """A SHA-256 hex digest of the config, the epoch and every assignment (equal plans, equal digests)."""
        digest = hashlib.sha256(f"{self.config!r}|{self.epoch}".encode())
        for array in (self._members, self._bounds, self._slots, self._step_loss_tokens):
            digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"Plan(epoch={self.epoch}, num_steps={self.num_steps}, config={self.config!r})"


def build_plan(
    lengths: Sequence[int] | np.ndarray,
    config: PlanConfig,
    *,
    epoch: int,
    loss_tokens: Sequence[int] | np.ndarray | None = None,
) -> Plan:
    """Plan one epoch: the microbatches of every rank at every optimizer step.

    Args:
        lengths: token count of every sample of the dataset.
        config: what to plan.
        epoch: the epoch (>= 0); with ``config.shuffle`` it seeds the order.
        loss_tokens: tokens that carry a loss in each sample; default ``max(length - 1, 0)``.

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: bad lengths or loss tokens, or a sample longer than ``max_tokens`` (packing and
            dynamic; the message names the index, the length and ``max_tokens``).

    Example:
        >>> cfg = PlanConfig(mode="packing", max_tokens=8, world_size=2, shuffle=False)
        >>> plan = build_plan([5, 3, 4, 4, 2], cfg, epoch=0)  # 3 bins, one split in two: 2 steps of 2
        >>> plan.rank_microbatches(0), plan.rank_microbatches(1), plan.step_loss_tokens.tolist()
        ([[2, 3], [1]], [[0], [4]], [10, 3])
    """
    check_int("epoch", epoch, minimum=0)
    lengths = as_counts("lengths", lengths)
    loss = None  # max(length - 1, 0), computed where the figures are
    if loss_tokens is not None:
        loss = as_counts("loss_tokens", loss_tokens, lengths.size)
        above = np.flatnonzero(loss > lengths)
        if above.size:
            i = int(above[0])
            raise ValueError(f"loss_tokens[{i}] = {int(loss[i])} exceeds the sample's length {int(lengths[i])}")
    check_budget(lengths, config)
    n = lengths.size
    window = config.window or auto_window(config, n, int(lengths.sum()))
    order = WindowOrder(n, config, epoch, window, WindowOrder.partition_for(n, config, window))
    windows, offset = [], 0
    for w in range(order.num_windows):
        planned = plan_window(lengths, loss, order.positions(w), config, epoch, w)
        windows.append(planned._replace(grid=planned.grid + offset))
        offset += planned.sizes.size
    return _assemble(config, epoch, lengths, windows)


def plan_packed(
    lengths: Sequence[int] | np.ndarray,
    bins: tuple[np.ndarray, np.ndarray],
    config: PlanConfig,
    *,
    epoch: int,
    loss_tokens: Sequence[int] | np.ndarray | None = None,
) -> Plan:
    """Plan one window of samples already packed: their bins on the steps and ranks, as :func:`build_plan` would.

    The streaming buffer packs a window once, holds its least-full bins back for the next window and plans the rest
    as packed (a second packing could make other bins). Bins are split (the fullest first) to fill whole steps, or
    padded with empty lock-step fillers when there are fewer samples than slots.

    Args:
        lengths: token count of every sample of the window (packing mode).
        bins: ``(flat, ends)``: bin ``b`` is ``flat[ends[b - 1]:ends[b]]`` (as
            :meth:`~lit_seqpack.planning.algorithms.Packer.pack_flat`), every sample once, each within ``max_tokens``.
        config: the plan configuration (``mode="packing"``).
        epoch: seeds the balancing when ``config.shuffle``.
        loss_tokens: tokens that carry a loss in each sample; default ``max(length - 1, 0)``.

    Raises:
        ValueError: ``config`` is not a packing plan, the bins do not hold every sample once (or one is empty), a bin
            holds more than ``max_tokens``, or a sample's loss tokens exceed its length.

    Example:
        >>> cfg = PlanConfig(mode="packing", max_tokens=8, world_size=2, shuffle=False)
        >>> plan = plan_packed([5, 3, 4, 4], (np.array([0, 1, 2, 3]), np.array([2, 4])), cfg, epoch=0)
        >>> plan.rank_microbatches(0), plan.rank_microbatches(1)
        ([[0, 1]], [[2, 3]])
    """
    if config.mode != "packing":
        raise ValueError(f"plan_packed plans packed bins (mode='packing'), got mode={config.mode!r}")
    check_int("epoch", epoch, minimum=0)
    lengths = as_counts("lengths", lengths)
    loss = None if loss_tokens is None else as_counts("loss_tokens", loss_tokens, lengths.size)
    if loss is not None and bool((loss > lengths).any()):
        i = int(np.flatnonzero(loss > lengths)[0])
        raise ValueError(f"loss_tokens[{i}] = {int(loss[i])} exceeds the sample's length {int(lengths[i])}")
    flat, ends = (np.asarray(part, dtype=np.int64) for part in bins)
    if flat.size != lengths.size or not np.array_equal(np.sort(flat), np.arange(lengths.size)):
        raise ValueError(f"the bins must hold each of the {lengths.size} samples once, got {flat.size} entries")
    if ends.size and (ends[-1] != flat.size or bool((np.diff(ends, prepend=0) < 1).any())):
        raise ValueError(f"bin ends {ends.tolist()[:8]} must rise by at least 1 and end at {flat.size}")
    starts = np.concatenate(([0], ends[:-1]))
    fills = np.add.reduceat(lengths[flat], starts) if ends.size else np.zeros(0, dtype=np.int64)
    if fills.size and int(fills.max()) > config.max_tokens:
        b = int(np.argmax(fills))
        raise ValueError(f"bin {b} holds {int(fills[b])} tokens, more than max_tokens={config.max_tokens}")
    target = -(-max(ends.size, 1) // config.slots_per_step) * config.slots_per_step
    real = min(target, lengths.size)
    if real > ends.size:
        flat, ends = split_fullest_flat(flat, ends, lengths, fills, real)
    sizes = np.concatenate([np.diff(ends, prepend=0), np.zeros(target - real, dtype=np.int64)])
    window = slot_window(lengths, loss, None, flat, sizes, config, window_seeds(config, epoch, 0))
    return _assemble(config, epoch, lengths, [window])


def _assemble(config: PlanConfig, epoch: int, lengths: np.ndarray, windows: list[WindowPlan]) -> Plan:
    """Join the windows (grids already offset to global microbatch ids) into a :class:`Plan` with its stats."""
    empty_grid = np.zeros((0, config.world_size, config.accumulate_grad_batches), dtype=np.int64)
    all_members = _joined([w.members for w in windows], np.zeros(0, dtype=np.int64))
    all_sizes = _joined([w.sizes for w in windows], np.zeros(0, dtype=np.int64))
    grid = _joined([w.grid for w in windows], empty_grid)
    figures = {
        key: _joined([w.figures[key] for w in windows], np.zeros(0, dtype=np.int64))
        for key in ("tokens", "loss_tokens", "computed")
    }
    imbalance_mean, imbalance_max = step_imbalance(figures["tokens"], grid)
    real, computed = int(lengths.sum()), int(figures["computed"].sum())
    budget = config.max_tokens or int(figures["computed"].max(initial=0))
    stats = PlanStats(
        num_samples=int(lengths.size),
        num_steps=int(grid.shape[0]),
        num_microbatches=int(all_sizes.size),
        num_empty_microbatches=int(np.count_nonzero(all_sizes == 0)),
        real_tokens=real,
        computed_tokens=computed,
        padding_ratio=1.0 - real / computed if computed else 0.0,
        utilization=real / (all_sizes.size * budget) if all_sizes.size and budget else 0.0,
        imbalance_mean=imbalance_mean,
        imbalance_max=imbalance_max,
    )
    return Plan(
        config=config,
        epoch=epoch,
        members=all_members,
        bounds=np.concatenate(([0], np.cumsum(all_sizes))),
        slots=grid,
        step_loss_tokens=figures["loss_tokens"][grid].sum(axis=(1, 2)),
        stats=stats,
    )


def _joined(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    """``np.concatenate([empty, *parts])`` as ``int64``, without copying a single part (one window: the epoch)."""
    if len(parts) == 1 and parts[0].dtype == np.int64:
        return parts[0]
    return np.concatenate([empty, *parts])
