"""How a stream window is packed: the least-full rows wait for the next window, the last window is spread evenly.

A window is packed once and planned as packed (:func:`~lit_seqpack.planning.plan.plan_packed`):

- :func:`carried_over`: every window but the last holds back the samples of its least-full bins (below
  :data:`CARRY_FILL` of ``max_tokens``, or needed to fill whole optimizer steps) for the next window, so every row
  trained before the stream's end is nearly full, whatever the window's boundaries;
- :func:`even_bins`: the last window has no next one, and its leftover tokens would make one half-empty row (a
  slow rank at that step). Its samples are spread over the same number of rows as evenly as they go, so each rank's
  last steps are all about equally full and ranks ending at different steps stay balanced.
"""

from __future__ import annotations

import heapq

import numpy as np

from lit_seqpack.planning._windows import window_seeds
from lit_seqpack.planning.algorithms import get_packer, pack_first, packing_algorithm
from lit_seqpack.planning.plan import PlanConfig

__all__ = ["CARRY_FILL", "carried_over", "even_bins", "packer_seed"]

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
