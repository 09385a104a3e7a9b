"""Reaching a bin count by splitting the fullest bins, on flat bins (``flat`` items, ``ends`` per bin).

Only the ``target - n_bins`` fullest splittable bins can ever be split (each split creates one bin), so
only those become Python lists; every other bin stays a slice of ``flat``. A split bin keeps its place,
its second half is appended, exactly as :func:`split_fullest` does on lists.
"""

from __future__ import annotations

import heapq

import numpy as np

from lit_seqpack.planning._sorting import largest

__all__ = ["split_fullest", "split_fullest_flat"]


def split_fullest(bins: list[list[int]], sizes: np.ndarray, fills: np.ndarray, splits: int) -> list[list[int]]:
    """Split the fullest splittable bin of ``bins`` in two, ``splits`` times (in place; returns ``bins``).

    ``fills`` holds each bin's tokens. A bin's halves: its items by decreasing size, the first two to
    different halves, then each to the lighter half (ties: the first). The half with the largest item
    keeps the bin's place, the other is appended. Both keep the bin's item order. Ties between equally
    full bins go to the lower index.
    """
    heap = [(-int(fills[i]), i) for i in range(len(bins)) if len(bins[i]) >= 2]
    heapq.heapify(heap)
    for _ in range(splits):
        _, i = heapq.heappop(heap)
        members = bins[i]
        by_size = sorted(range(len(members)), key=lambda k: -int(sizes[members[k]]))
        side = [0] * len(members)
        loads = [int(sizes[members[by_size[0]]]), int(sizes[members[by_size[1]]])]
        side[by_size[1]] = 1
        for k in by_size[2:]:
            side[k] = 0 if loads[0] <= loads[1] else 1
            loads[side[k]] += int(sizes[members[k]])
        bins[i] = [m for m, s in zip(members, side, strict=True) if s == 0]
        bins.append([m for m, s in zip(members, side, strict=True) if s == 1])
        for j, load in ((i, loads[0]), (len(bins) - 1, loads[1])):
            if len(bins[j]) >= 2:
                heapq.heappush(heap, (-load, j))
    return bins


def split_fullest_flat(
    flat: np.ndarray, ends: np.ndarray, sizes: np.ndarray, fills: np.ndarray, target: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(flat, ends)`` with ``target`` bins: the fullest bins split as :func:`split_fullest` would.

    Args:
        flat: item indices, bin by bin.
        ends: bin ``b`` holds ``flat[ends[b - 1]:ends[b]]`` (``ends[-1] == flat.size``).
        sizes: size of every item.
        fills: tokens of every bin.
        target: the bin count to reach (enough items must exist).

    Returns:
        The new ``(flat, ends)``.
    """
    n_bins = ends.size
    counts = np.diff(ends, prepend=0)
    splittable = np.flatnonzero(counts >= 2)
    candidates = largest(fills, splittable, target - n_bins)  # only these can ever be split
    starts = ends - counts
    local = [flat[starts[i] : ends[i]].tolist() for i in candidates]
    split_fullest(local, sizes, fills[candidates], target - n_bins)
    pieces, previous = [], 0
    for k, b in enumerate(candidates.tolist()):
        pieces += [flat[previous : starts[b]], np.asarray(local[k], dtype=flat.dtype)]
        previous = int(ends[b])
    pieces.append(flat[previous:])
    pieces += [np.asarray(half, dtype=flat.dtype) for half in local[candidates.size :]]
    counts[candidates] = [len(half) for half in local[: candidates.size]]
    counts = np.concatenate([counts, np.fromiter(map(len, local[candidates.size :]), np.int64)])
    return np.concatenate(pieces), np.cumsum(counts)
