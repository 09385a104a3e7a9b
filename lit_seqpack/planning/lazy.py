"""One epoch's plan, built a window at a time: what a rank needs, in memory bounded by a window.

:func:`~lit_seqpack.planning.build_plan` materialises every window of the epoch; a rank only reads its
own column, one step after the other. :class:`LazyPlan` gives the same microbatches (a test checks it
against ``build_plan``) but keeps only::

    always       lengths (and loss tokens) in their smallest dtype, the epoch order (explicit windows:
                 uint32 a sample; the auto order: one entry per block of samples), and the step count
                 of every window (counted up front: len() and lock-step need the total)
    on demand    the plan of the window holding the requested step (one cached; older ones dropped)

So memory is O(window) beyond a few bytes per sample, and a resume at step ``s`` plans the window
holding ``s``, not the windows before it (their steps are counted: O(N) time, O(window) memory).
Counting a window runs its packer's count (not the balancing): first fit decreasing counts from the
window's length histogram (``Packer.count_bins``), in a few steps per bin; the first window is planned
outright instead. With ``window=None`` on large data the chunks are the same every epoch and, for
sort-based packers, counted once (``chunk_steps``) in the chunk's own order (the count of a sort-based
packer does not depend on the order of its input).
"""

from __future__ import annotations

import hashlib

import numpy as np

from lit_seqpack.planning._order import ChunkPartition, WindowOrder, auto_window
from lit_seqpack.planning._windows import (
    check_budget,
    compact_counts,
    plan_window,
    window_seeds,
    window_steps,
)
from lit_seqpack.planning.algorithms import packing_algorithm
from lit_seqpack.planning.config import PlanConfig
from lit_seqpack.planning.plan import PlannedMicrobatch

__all__ = ["LazyPlan"]


class LazyPlan:
    """One epoch's plan, a window at a time; the same microbatches as :func:`~lit_seqpack.planning.build_plan`.

    Args:
        lengths: token count of every sample (any integer dtype; kept in the smallest one).
        config: what to plan.
        epoch: the epoch.
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``, computed per window).
        partition: the epoch-independent chunks of the auto order, when the caller keeps them across
            epochs (default: computed here when they apply).
        chunk_steps: step count of every chunk from an earlier epoch (reused when it cannot change).

    Example:
        >>> cfg = PlanConfig(mode="packing", max_tokens=8, world_size=2, shuffle=False)
        >>> plan = LazyPlan([5, 3, 4, 4, 2], cfg, epoch=0)
        >>> [plan.microbatch(0, p).indices for p in range(plan.microbatches_per_rank)]
        [[2, 3], [1]]
    """

    def __init__(
        self,
        lengths: np.ndarray,
        config: PlanConfig,
        *,
        epoch: int,
        loss_tokens: np.ndarray | None = None,
        partition: ChunkPartition | None = None,
        chunk_steps: np.ndarray | None = None,
    ) -> None:
        self.config, self.epoch = config, epoch
        self._lengths = compact_counts("lengths", lengths)
        n = int(self._lengths.size)
        self._loss = None if loss_tokens is None else compact_counts("loss_tokens", loss_tokens, n)
        check_budget(self._lengths, config)
        self.window = config.window or auto_window(config, n, int(self._lengths.sum(dtype=np.int64)))
        if partition is None:
            partition = WindowOrder.partition_for(n, config, self.window)
        self.partition = partition
        self._order = WindowOrder(n, config, epoch, self.window, partition)
        self._cached: tuple[int, tuple[np.ndarray, ...]] | None = None
        self.chunk_steps = self._count(chunk_steps)
        steps = self.chunk_steps[[self._order.chunk(w) for w in range(self._order.num_windows)]]
        self._step_starts = np.concatenate(([0], np.cumsum(steps, dtype=np.int64)))

    def _count(self, known: np.ndarray | None) -> np.ndarray:
        """Steps of every chunk (window ``w`` trains chunk ``order.chunk(w)``)."""
        config, order = self.config, self._order
        sort_based = config.mode != "packing" or packing_algorithm(config.algorithm).sort_based
        if sort_based and order.counts_are_epoch_independent and known is not None and known.size == order.num_windows:
            return known
        steps = np.zeros(order.num_windows, dtype=np.int64)
        for w in range(order.num_windows):
            if w == 0:  # the first window is needed first: plan it now rather than count it, then plan it
                self._cached = (0, self._plan_arrays(0))
                steps[order.chunk(0)] = self._cached[1][2].shape[0]
                continue
            members = order.members(w) if sort_based else order.positions(w)  # a count that ignores order
            window_lengths = self._lengths[members]
            del members
            seed = int(window_seeds(config, self.epoch, w).generate_state(1)[0])
            steps[order.chunk(w)] = window_steps(window_lengths, config, seed)
        return steps

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the epoch."""
        return int(self._step_starts[-1])

    @property
    def microbatches_per_rank(self) -> int:
        """Microbatches each rank runs this epoch (the same on every rank)."""
        return self.num_steps * self.config.accumulate_grad_batches

    def _window(self, w: int) -> tuple[np.ndarray, ...]:
        if self._cached is not None and self._cached[0] == w:
            return self._cached[1]
        self._cached = None  # drop the previous window before planning the next one
        arrays = self._plan_arrays(w)
        expected = int(self._step_starts[w + 1] - self._step_starts[w])
        if arrays[2].shape[0] != expected:  # the count and the plan must agree, or ranks desynchronise
            raise RuntimeError(f"window {w} planned {arrays[2].shape[0]} steps, {expected} were counted")
        self._cached = (w, arrays)
        return arrays

    def _plan_arrays(self, w: int) -> tuple[np.ndarray, ...]:
        """Window ``w``'s members, bounds, ``[steps, ranks, slots]`` grid, step and microbatch loss tokens."""
        positions = self._order.positions(w)
        lengths = self._lengths[positions].astype(np.int64)
        loss = None if self._loss is None else self._loss[positions].astype(np.int64)  # None: length - 1
        planned = plan_window(lengths, loss, None, self.config, self.epoch, w)
        del lengths, loss
        loss_per_microbatch = planned.figures["loss_tokens"]
        return (
            positions[planned.members],
            np.concatenate(([0], np.cumsum(planned.sizes))),
            planned.grid,
            loss_per_microbatch[planned.grid].sum(axis=(1, 2)),
            loss_per_microbatch,
        )

    def _locate(self, rank: int, position: int) -> tuple[int, int, tuple[np.ndarray, ...]]:
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be in [0, {self.config.world_size}), got {rank}")
        if not 0 <= position < self.microbatches_per_rank:
            raise IndexError(f"position {position} out of range for {self.microbatches_per_rank} microbatches")
        step, slot = divmod(position, self.config.accumulate_grad_batches)
        w = int(np.searchsorted(self._step_starts, step, side="right")) - 1
        arrays = self._window(w)
        local = step - int(self._step_starts[w])
        return step, local, arrays + (int(arrays[2][local, rank, slot]),)

    def microbatch(self, rank: int, position: int) -> PlannedMicrobatch:
        """The ``position``-th microbatch (0-based, in training order) of ``rank``."""
        step, local, (members, bounds, _, step_loss, _, m) = self._locate(rank, position)
        return PlannedMicrobatch(members[bounds[m] : bounds[m + 1]].tolist(), step, int(step_loss[local]))

    def microbatch_loss_tokens(self, rank: int, position: int) -> int:
        """Loss tokens of that microbatch alone."""
        *_, (_, _, _, _, loss, m) = self._locate(rank, position)
        return int(loss[m])

    def rank_microbatches(self, rank: int) -> list[list[int]]:
        """All microbatches of ``rank`` in training order (plans every window in turn)."""
        return [self.microbatch(rank, p).indices for p in range(self.microbatches_per_rank)]

    def fingerprint(self) -> str:
        """A SHA-256 of the config, the epoch, the lengths, the loss tokens and the step counts (cheap)."""
        digest = hashlib.sha256(f"{self.config!r}|{self.epoch}".encode())
        for array in (self._lengths, self._loss, self._step_starts):
            digest.update(b"-" if array is None else array.tobytes())
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"LazyPlan(epoch={self.epoch}, num_steps={self.num_steps}, window={self.window}, config={self.config!r})"
