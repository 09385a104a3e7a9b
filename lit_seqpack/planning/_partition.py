"""Multiway number partitioning: split weighted items into ``k`` parts of near-equal sums (Karmarkar-Karp).

The largest differencing method keeps a heap of partial partitions, each ``k`` sums with their members. It
starts with one partition per item (the item alone in its first part) and repeatedly merges the two partitions
with the largest spread (max sum minus min sum), pairing the heaviest part of one with the lightest part of the
other, until one partition is left::

    costs 8 7 6 5 4, k = 2     (8|0) (7|0) (6|0) (5|0) (4|0)
    merge (8|0) + (7|0)   ->   (8|7)  spread 1
    merge (6|0) + (5|0)   ->   (6|5)  spread 1 ... down to (8+5+... | 7+6+...)

Pure Python + numpy, deterministic (ties broken by creation order).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from lit_seqpack._checks import check_int

__all__ = ["karmarkar_karp"]


def karmarkar_karp(costs: Sequence[float] | np.ndarray, parts: int) -> list[list[int]]:
    """Partition item indices into ``parts`` lists whose cost sums are near equal.

    Args:
        costs: the cost of every item (finite, >= 0).
        parts: the number of parts (>= 1).

    Returns:
        ``parts`` lists of item indices (each index exactly once; a list may be empty when there are fewer items
        than parts), heaviest part first, each in increasing index order.

    Example:
        >>> karmarkar_karp([8, 7, 6, 5, 4], 2)
        [[1, 3, 4], [0, 2]]
    """
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("costs must be a 1-D array of finite numbers >= 0")
    parts = check_int("parts", parts, minimum=1)
    if values.size == 0:
        return [[] for _ in range(parts)]
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    for i in np.argsort(-values, kind="stable").tolist():
        sums = np.zeros(parts)
        sums[0] = values[i]
        heap.append((-float(values[i]), len(heap), sums, [[i]] + [[] for _ in range(parts - 1)]))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        merged = sums_a + sums_b[::-1]  # heaviest of one with the lightest of the other
        order = np.argsort(-merged, kind="stable")
        members = [members_a[j] + members_b[parts - 1 - j] for j in order.tolist()]
        sums = merged[order]
        heapq.heappush(heap, (-float(sums[0] - sums[-1]), counter, sums, members))
        counter += 1
    return [sorted(part) for part in heap[0][3]]
