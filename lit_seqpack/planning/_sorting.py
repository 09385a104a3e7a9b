"""Decreasing orders of integer sizes: counting sorts where the sizes are small, numpy's stable sort otherwise.

``decreasing_order(sizes)`` is ``np.argsort(-sizes, kind="stable")`` (equal sizes keep index order), computed from
the histogram when the largest size is small next to the input: one pass to count, one to place (compiled with
numba, see ``_kernels``), instead of an ``n log n`` comparison sort. The packers and dynamic batching share it.
"""

from __future__ import annotations

import numpy as np

from lit_seqpack.planning import _kernels

__all__ = ["DENSE_HISTOGRAM_MAX", "decreasing_order", "decreasing_runs", "dense_histogram", "largest"]

DENSE_HISTOGRAM_MAX = 1 << 24  # sizes below this are counted with bincount, larger ones with unique


def dense_histogram(sizes: np.ndarray) -> np.ndarray | None:
    """``bincount(sizes)`` when it is small next to the input (a counting sort pays), else ``None``."""
    top = int(sizes.max()) if sizes.shape[0] else 0
    if top >= DENSE_HISTOGRAM_MAX or top > max(1 << 16, 4 * sizes.shape[0]):
        return None
    return np.bincount(sizes)


def decreasing_order(sizes: np.ndarray, histogram: np.ndarray | None = None) -> np.ndarray:
    """Indices by decreasing size; equal sizes keep index order (a counting sort when the sizes are small).

    Example:
        >>> decreasing_order(np.array([2, 5, 2, 0])).tolist()
        [1, 0, 2, 3]
    """
    histogram = dense_histogram(sizes) if histogram is None else histogram
    if histogram is None:
        return np.argsort(-sizes, kind="stable")
    above = np.cumsum(histogram[::-1])[::-1] - histogram  # items larger than each size
    return _kernels.get_kernel("decreasing_order")(sizes, above.astype(np.int64))


def decreasing_runs(sizes: np.ndarray, histogram: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The distinct sizes in decreasing order and how many items have each (the runs of a decreasing sort).

    Example:
        >>> [a.tolist() for a in decreasing_runs(np.array([2, 5, 2, 0]))]
        [[5, 2, 0], [1, 2, 1]]
    """
    counts = dense_histogram(sizes) if histogram is None else histogram
    if counts is not None:
        present = np.flatnonzero(counts)[::-1]
        return present.astype(np.int64), counts[present].astype(np.int64)
    values, counts = np.unique(sizes, return_counts=True)
    return values[::-1].astype(np.int64), counts[::-1].astype(np.int64)


def largest(values: np.ndarray, candidates: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` candidates with the largest ``values[candidate]`` (ties: lower index first), in index order.

    ``np.sort(candidates[np.lexsort((candidates, -values[candidates]))][:count])`` in O(n) (a partition, no sort):
    the planner only ever needs a handful of the largest bins or groups. ``candidates`` are increasing indices.

    Example:
        >>> largest(np.array([3, 5, 3, 1, 3]), np.arange(5), 3).tolist()
        [0, 1, 2]
    """
    candidates = np.asarray(candidates)
    if candidates.size <= count:
        return np.sort(candidates)
    if count <= 0:
        return candidates[:0]
    chosen = values[candidates]
    threshold = np.partition(chosen, chosen.size - count)[chosen.size - count]
    above = candidates[chosen > threshold]
    tied = candidates[chosen == threshold][: count - above.size]  # increasing: the lowest indices first
    return np.sort(np.concatenate([above, tied]))
