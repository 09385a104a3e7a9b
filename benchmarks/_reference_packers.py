"""Textbook pure-Python packers: the baseline of ``bench_planner.py`` and a cross-check in the tests.

Each function follows the algorithm's description literally, with Python lists and linear scans over the
open bins (O(n x bins)), the way pure-Python packers are usually written (e.g. NeMo-RL's). They break
ties exactly like ``lit_seqpack.planning`` (stable decreasing order; best fit prefers the bin that
changed last), so on the same input they return the same bins, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["REFERENCE_PACKERS"]


def _decreasing(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def concatenative(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """New bin whenever the next item does not fit the current one."""
    bins: list[list[int]] = []
    used = capacity + 1
    for i, size in enumerate(lengths):
        if used + size > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += size
    return bins


def _first_fit_into(
    bins: list[list[int]], room: list[int], order: Sequence[int], lengths: Sequence[int], capacity: int
) -> list[list[int]]:
    """Each item of ``order`` into the first bin with room (scanning from bin 0), else a new bin."""
    for i in order:
        b = next((b for b, free in enumerate(room) if free >= lengths[i]), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    return _first_fit_into([], [], order, lengths, capacity)


def first_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """Longest first, each into the first bin with room."""
    return _first_fit(_decreasing(lengths), lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """First fit in the order ``numpy.random.default_rng(seed).permutation``."""
    return _first_fit(np.random.default_rng(seed).permutation(len(lengths)).tolist(), lengths, capacity)


def best_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """Longest first, each into the bin with the least room that fits (ties: the bin changed last)."""
    bins: list[list[int]] = []
    room: list[int] = []
    changed: list[int] = []
    for step, i in enumerate(_decreasing(lengths)):
        best = -1
        for b, free in enumerate(room):
            if free >= lengths[i] and (best < 0 or (free, -changed[b]) < (room[best], -changed[best])):
                best = b
        if best < 0:
            best = len(bins)
            bins.append([])
            room.append(capacity)
            changed.append(step)
        bins[best].append(i)
        room[best] -= lengths[i]
        changed[best] = step
    return bins


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """Johnson & Garey (1985) MFFD: large (> C/2), medium (> C/3), small (> C/6) and tiny items."""
    order = _decreasing(lengths)
    large = [i for i in order if 2 * lengths[i] > capacity]
    medium = [i for i in order if 3 * lengths[i] > capacity >= 2 * lengths[i]]
    small = [i for i in order if 6 * lengths[i] > capacity >= 3 * lengths[i]]
    bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]

    def take_largest(pool: list[int], b: int) -> bool:
        for k, i in enumerate(pool):
            if lengths[i] <= room[b]:
                bins[b].append(pool.pop(k))
                room[b] -= lengths[i]
                return True
        return False

    with_medium = [take_largest(medium, b) for b in range(len(bins))]
    for b in reversed(range(len(bins))):
        if len(small) < 2:
            break
        if not with_medium[b] and lengths[small[-1]] + lengths[small[-2]] <= room[b]:
            bins[b].append(small.pop())
            room[b] -= lengths[bins[b][-1]]
            take_largest(small, b)
    taken = {i for b in bins for i in b}
    rest = [i for i in order if i not in taken]
    for b in range(len(bins)):
        while take_largest(rest, b):
            pass
    return _first_fit_into(bins, room, rest, lengths, capacity)


REFERENCE_PACKERS: dict[str, Callable[[Sequence[int], int, int], list[list[int]]]] = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "best_fit_decreasing": best_fit_decreasing,
}
