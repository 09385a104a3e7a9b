"""Dynamic (token-budget) batching, and the fixed-size groups of the padded baseline.

A dynamic microbatch is a padded ``[rows, L]`` block with ``L = round_up(longest row, sequence_length_round)``,
so its cost in the budget is ``rows x L``. Sorting the window by length (longest first) makes the first
row of each group its longest, so a group simply takes ``max_tokens // L`` rows::

    lengths (sorted)   900 700 690 400 390 380 120 100 90 ...
    max_tokens 2048    [900 700]  [690 400]  [390 380 120 100 90]  ...
    padded shape       2 x 900    2 x 690    5 x 390

Lock-step needs the group count of a window to be a multiple of ``world_size x accumulate_grad_batches``.
Instead of adding idle microbatches, :func:`dynamic_groups` splits the largest groups (by rows) in two:
a half of a sorted group is still a sorted group and fits the budget. Only when every group is a single
row (fewer samples than slots) are empty groups appended.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from lit_seqpack._checks import round_up  # re-exported: the planner's modules import it from here
from lit_seqpack.planning import _kernels
from lit_seqpack.planning._sorting import largest

__all__ = ["dynamic_group_sizes", "dynamic_groups", "fixed_group_sizes", "round_up", "run_group_sizes"]


def dynamic_group_sizes(
    sorted_lengths: np.ndarray,
    max_tokens: int,
    *,
    sequence_length_round: int = 1,
    group_count_multiple: int = 1,
) -> np.ndarray:
    """Row counts of consecutive groups of lengths sorted in decreasing order.

    Args:
        sorted_lengths: lengths in decreasing order, each at most ``max_tokens`` after rounding.
        max_tokens: the budget: ``rows x round_up(max_len, sequence_length_round) <= max_tokens``.
        sequence_length_round: the padded length of a group is a multiple of this.
        group_count_multiple: the number of groups (zero-row groups included) is a multiple of this.

    Returns:
        An ``int64`` array of row counts; consecutive slices of ``sorted_lengths`` of these sizes are the
        groups, and trailing zeros are empty groups.

    Example:
        >>> sorted_lengths = np.array([900, 700, 690, 400, 390, 380, 120])
        >>> dynamic_group_sizes(sorted_lengths, 2048).tolist()
        [2, 2, 3]
        >>> dynamic_group_sizes(sorted_lengths, 2048, group_count_multiple=4).tolist()
        [2, 2, 2, 1]
    """
    padded = np.asarray(round_up(np.asarray(sorted_lengths, dtype=np.int64), sequence_length_round))
    if padded.size and np.any(padded[:-1] < padded[1:]):
        raise ValueError("sorted_lengths must be in decreasing order")
    if padded.size and padded[0] > max_tokens:
        raise ValueError(f"a length rounded up to {int(padded[0])} exceeds max_tokens={max_tokens}")
    # rows allowed when a group starts at position i; 0-length rows cost nothing but still take a row
    rows_at = max_tokens // np.maximum(padded, 1)
    sizes = _kernels.get_kernel("greedy_group_sizes")(rows_at)
    return _split_to_multiple(sizes, group_count_multiple)


def run_group_sizes(
    run_lengths: np.ndarray,
    run_counts: np.ndarray,
    max_tokens: int,
    *,
    sequence_length_round: int = 1,
    group_count_multiple: int = 1,
) -> np.ndarray:
    """:func:`dynamic_group_sizes` of ``np.repeat(run_lengths, run_counts)``, from the runs of equal lengths.

    One division per distinct length instead of one per row (the planner has the runs from its counting sort).
    ``run_lengths`` must be decreasing and fit the budget after rounding (not checked here).

    Example:
        >>> run_group_sizes(np.array([900, 400, 120]), np.array([2, 3, 2]), 2048).tolist()
        [2, 5]
    """
    rows = max_tokens // np.maximum(round_up(np.asarray(run_lengths, dtype=np.int64), sequence_length_round), 1)
    sizes = _kernels.get_kernel("greedy_group_sizes")(np.repeat(rows, run_counts))
    return _split_to_multiple(sizes, group_count_multiple)


def _split_to_multiple(sizes: np.ndarray, multiple: int) -> np.ndarray:
    """Split the largest groups into near-equal parts until ``len`` is a multiple; pad with empty groups.

    Parts of a group stay adjacent, so every part is still a run of the sorted order and fits the budget. Each
    split goes to the group whose largest part is the largest (ties: the first group), so the ``missing`` splits
    all fall on the ``missing`` largest groups: only those enter the heap (``missing < multiple``), and the
    others are copied as they are.
    """
    missing = (-sizes.size) % multiple
    if missing == 0:
        return sizes
    parts = {int(g): 1 for g in largest(sizes, np.flatnonzero(sizes >= 2), missing)}
    heap = [(-int(sizes[g]), g) for g in parts]  # max-heap on the largest part of each group that can be split
    heapq.heapify(heap)
    while missing and heap:
        _, g = heapq.heappop(heap)
        parts[g] += 1
        missing -= 1
        if parts[g] < sizes[g]:
            heapq.heappush(heap, (-int(sizes[g]) // parts[g], g))  # minus the largest part
    pieces, previous = [], 0
    for g in sorted(parts):
        base, extra = divmod(int(sizes[g]), parts[g])
        pieces += [sizes[previous:g], np.array([base + 1] * extra + [base] * (parts[g] - extra), dtype=np.int64)]
        previous = g + 1
    return np.concatenate([*pieces, sizes[previous:], np.zeros(missing, dtype=np.int64)])


def dynamic_groups(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    sequence_length_round: int = 1,
    group_count_multiple: int = 1,
) -> list[list[int]]:
    """Group positions of ``lengths`` into padded microbatches of at most ``max_tokens`` tokens.

    Args:
        lengths: sequence lengths, in any order.
        max_tokens: token budget of one padded microbatch (``rows x padded length``).
        sequence_length_round: the padded length is rounded up to a multiple of this.
        group_count_multiple: the number of groups is a multiple of this (largest groups are split,
            empty groups appended only when nothing can be split).

    Returns:
        Groups of indices into ``lengths``, longest first within and across groups; empty lists are
        lock-step fillers.

    Example:
        >>> dynamic_groups([120, 900, 390, 700, 400, 690, 380], 2048)
        [[1, 3], [5, 4], [2, 6, 0]]
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    order = np.argsort(-arr, kind="stable")
    sizes = dynamic_group_sizes(
        arr[order],
        max_tokens,
        sequence_length_round=sequence_length_round,
        group_count_multiple=group_count_multiple,
    )
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return [order[bounds[g] : bounds[g + 1]].tolist() for g in range(sizes.size)]


def fixed_group_sizes(num_samples: int, batch_size: int, *, group_count_multiple: int = 1) -> np.ndarray:
    """Row counts of the padded baseline: consecutive batches of ``batch_size``, the last one shorter.

    The group count is padded to a multiple of ``group_count_multiple`` with empty groups (never by
    dropping samples).

    Example:
        >>> fixed_group_sizes(10, 4, group_count_multiple=2).tolist()
        [4, 4, 2, 0]
    """
    full, rest = divmod(num_samples, batch_size)
    sizes = [batch_size] * full + ([rest] if rest else [])
    return np.asarray(sizes + [0] * ((-len(sizes)) % group_count_multiple), dtype=np.int64)
