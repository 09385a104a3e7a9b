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
from typing import Literal, NamedTuple

import numpy as np

from lit_seqpack.planning._balance import step_imbalance
from lit_seqpack.planning._order import WindowOrder, auto_window
from lit_seqpack.planning._windows import as_counts, check_budget, microbatch_figures, plan_window

__all__ = [
    "MICROBATCH_ORDERS",
    "MODES",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "PlannedMicrobatch",
    "as_counts",
    "build_plan",
]

MODES: tuple[str, ...] = ("packing", "dynamic", "padded")
MICROBATCH_ORDERS: tuple[str, ...] = ("packer", "largest_first")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What to plan: the batching mode, its budget and the distributed layout.

    Args:
        mode: ``"packing"`` (rows of concatenated documents), ``"dynamic"`` (padded ``[rows, L]`` blocks
            under a token budget) or ``"padded"`` (fixed ``batch_size``, the baseline). One field, so
            packing and dynamic batching cannot both be on.
        max_tokens: token budget of a microbatch (packing: the row length after rounding; dynamic:
            ``rows x round_up(longest, sequence_length_round)``). Required for packing and dynamic,
            must be ``None`` for padded.
        algorithm: packing algorithm (see ``PACKING_ALGORITHMS``); only for packing, where ``None``
            means ``"first_fit_decreasing"``.
        window: consecutive shuffled samples planned together; window ``i`` trains entirely before
            window ``i + 1``. ``None``: the whole epoch (the most efficient; sort-based packers then give
            the same microbatch count every epoch) up to ``max(2**22, 128 steps)`` samples; larger data is
            cut into fixed chunks of that size, the same every epoch, trained in a new order each epoch
            (memory stays bounded and the count stays constant; see ``planning._order``).
        sequence_length_round: rows are padded to a multiple of this (packing: the packed row;
            dynamic/padded: the longest row). ``max_tokens`` must be a multiple of it.
        batch_size: samples per microbatch in padded mode (required there, ``None`` otherwise).
        world_size: number of data-parallel ranks.
        accumulate_grad_batches: microbatches per rank per optimizer step.
        seed: seed of the shuffles (>= 0).
        shuffle: shuffle samples (and steps) with ``(seed, epoch)``; ``False`` gives the same plan
            every epoch.
        microbatch_order: ``"largest_first"`` runs each rank's costliest microbatch of a step first and
            puts the step holding the window's costliest microbatch first (allocator sees the peak
            shape first); ``"packer"`` keeps the packer's order within a rank's step.
        cost_linear: ``a`` in the per-document cost ``a*L + b*L^2`` that ranks are balanced on.
        cost_quadratic: ``b`` in that cost (attention-heavy long contexts); dynamic and padded blocks
            cost ``rows x (a*Lp + b*Lp^2)`` with ``Lp`` the padded length. ``"auto"`` (the default) is
            ``cost_linear / max_tokens``: a document as long as the budget spends as much on attention as on
            the rest of the layer, so a step of a few long documents is not dealt to one rank as if it cost
            its tokens (see :attr:`quadratic_cost`); padded mode has no budget and balances on ``L`` alone.
    """

    mode: str = "packing"
    max_tokens: int | None = None
    algorithm: str | None = None
    window: int | None = None
    sequence_length_round: int = 1
    batch_size: int | None = None
    world_size: int = 1
    accumulate_grad_batches: int = 1
    seed: int = 0
    shuffle: bool = True
    microbatch_order: str = "largest_first"
    cost_linear: float = 1.0
    cost_quadratic: float | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name, minimum in (("sequence_length_round", 1), ("world_size", 1), ("accumulate_grad_batches", 1)):
            _check_int(name, getattr(self, name), minimum)
        _check_int("seed", self.seed, 0)
        if self.window is not None:
            _check_int("window", self.window, 1)
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be a bool, got {self.shuffle!r}")
        if self.microbatch_order not in MICROBATCH_ORDERS:
            raise ValueError(f"microbatch_order must be one of {MICROBATCH_ORDERS}, got {self.microbatch_order!r}")
        for name, allowed in (("cost_linear", ""), ("cost_quadratic", " or 'auto'")):
            value = getattr(self, name)
            if allowed and isinstance(value, str) and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0{allowed}, got {value!r}")
        self._check_mode_knobs()
        if self.cost_linear == 0 and self.quadratic_cost == 0:
            raise ValueError("cost_linear and cost_quadratic cannot both be 0")

    def _check_mode_knobs(self) -> None:
        if self.algorithm is not None:
            from lit_seqpack.planning.algorithms import PACKING_ALGORITHMS

            if self.mode != "packing":
                raise ValueError(f"algorithm={self.algorithm!r} only applies to mode='packing', not {self.mode!r}")
            if self.algorithm not in PACKING_ALGORITHMS:
                raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {self.algorithm!r}")
        if self.mode == "padded":
            if self.max_tokens is not None:
                raise ValueError(f"max_tokens={self.max_tokens!r} does not apply to mode='padded' (use batch_size)")
            _check_int("batch_size", self.batch_size, 1)
            return
        if self.batch_size is not None:
            raise ValueError(f"batch_size={self.batch_size!r} only applies to mode='padded', not {self.mode!r}")
        _check_int("max_tokens", self.max_tokens, 1)
        if self.max_tokens % self.sequence_length_round:
            raise ValueError(
                f"max_tokens={self.max_tokens} must be a multiple of sequence_length_round={self.sequence_length_round}"
            )

    @property
    def quadratic_cost(self) -> float:
        """The ``b`` ranks are balanced on: ``cost_quadratic``, or for ``"auto"`` ``cost_linear / max_tokens``.

        Why the budget: per token, a transformer layer spends a constant on its projections and MLP and a
        term that grows with the document's length on attention. Their ratio depends on the model (about
        ``L / (12 d)`` in FLOPs for hidden size ``d``, more in time since attention kernels run below matmul
        peak), which the planner does not know; the budget is the one length scale it does know, and ``b =
        a / max_tokens`` weighs a full-budget document's attention like its linear work. Packed rows are
        near full, so their token balance does not move (bench_plan's balance table), while the per-step
        attention-heavy cost goes from 1.15-1.32 max/mean over ranks to 1.002-1.004.

        Example:
            >>> PlanConfig(mode="packing", max_tokens=4096).quadratic_cost == 1 / 4096
            True
        """
        if not isinstance(self.cost_quadratic, str):
            return float(self.cost_quadratic)
        return self.cost_linear / self.max_tokens if self.max_tokens else 0.0

    @property
    def slots_per_step(self) -> int:
        """Microbatches per optimizer step over all ranks: ``world_size x accumulate_grad_batches``."""
        return self.world_size * self.accumulate_grad_batches


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
    _check_int("epoch", epoch, 0)
    lengths = as_counts("lengths", lengths)
    if loss_tokens is None:
        loss = np.maximum(lengths - 1, 0)
    else:
        loss = as_counts("loss_tokens", loss_tokens, lengths.size)
        above = np.flatnonzero(loss > lengths)
        if above.size:
            i = int(above[0])
            raise ValueError(f"loss_tokens[{i}] = {int(loss[i])} exceeds the sample's length {int(lengths[i])}")
    check_budget(lengths, config)
    n = lengths.size
    window = config.window or auto_window(config, n, int(lengths.sum()))
    order = WindowOrder(n, config, epoch, window, WindowOrder.partition_for(n, config, window))
    members, sizes, slots, offset = [], [], [], 0
    for w in range(order.num_windows):
        planned = plan_window(lengths, loss, order.positions(w), config, epoch, w)
        slots.append(planned.grid + offset)
        members.append(planned.members)
        sizes.append(planned.sizes)
        offset += planned.sizes.size
    return _assemble(config, epoch, lengths, loss, members, sizes, slots)


def _assemble(
    config: PlanConfig,
    epoch: int,
    lengths: np.ndarray,
    loss: np.ndarray,
    members: list[np.ndarray],
    sizes: list[np.ndarray],
    slots: list[np.ndarray],
) -> Plan:
    """Join the windows into a :class:`Plan` and compute its :class:`PlanStats`."""
    empty_grid = np.zeros((0, config.world_size, config.accumulate_grad_batches), dtype=np.int64)
    all_members = np.concatenate([np.zeros(0, dtype=np.int64), *members])
    all_sizes = np.concatenate([np.zeros(0, dtype=np.int64), *sizes])
    grid = np.concatenate([empty_grid, *slots])
    figures = microbatch_figures(lengths, loss, all_members, all_sizes, config)
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
