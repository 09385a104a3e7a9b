"""Bin-packing algorithms: which sequences share a microbatch of at most ``capacity`` tokens.

``get_packer(algorithm, capacity, ...).pack(lengths)`` returns bins as lists of indices into
``lengths``; every index appears exactly once and no bin holds more than ``capacity`` tokens.

Every algorithm is one :class:`PackingAlgorithm` record in ``ALGORITHMS`` (its name, its assigner, whether
it is sort based, a one-line description, whether it is the default); ``PACKING_ALGORITHMS``,
``DEFAULT_ALGORITHM``, the error messages, the inspection table and the list at the end of this docstring
are read from the records. Names are case-insensitive. A new algorithm is one assigner plus one record.

"Decreasing" orders are stable (equal lengths keep index order) and the first fit / best fit searches
use segment trees (O(n log n) in total), compiled with numba (see ``_kernels`` for the pure-Python
fallback and the ``LIT_SEQPACK_DISABLE_NUMBA`` switch). Decreasing orders are counting sorts when the
sizes are small integers, and first fit decreasing places equal sizes run by run from their histogram
(the same bins as item by item, a few tree steps per bin; ``count_bins`` needs no sort at all). Bins are
numbered in the order they are opened; inside a bin, indices follow the algorithm's processing order.
Same input and seed, same bins.

Lengths must be integers in ``[0, capacity]``. A zero-length sequence is valid and placed like any
other item (it fits in any bin), so "each index exactly once" holds for it too, and it counts as a
sequence when bins are split.

Bin counts: ``min_bin_count`` and ``bin_count_multiple`` (e.g. to give every rank the same number of
microbatches) set the final count to the smallest multiple of ``bin_count_multiple`` that is
``>= max(bins the algorithm made, min_bin_count)``. Extra bins come from splitting the fullest bin
that has at least two sequences into two halves of similar fill (largest first, each to the lighter
half), until the count is reached; a split bin is a subset of a valid bin, so capacity holds and the
fullest bin never gets fuller. Bins are never empty, so a count above the number of sequences raises
``ValueError``; so does ``min_bin_count > 0`` with no sequences.

Reaching a bin count by splitting the fullest bins, on flat bins (``flat`` items, ``ends`` per bin).

Only the ``target - n_bins`` fullest splittable bins can ever be split (each split creates one bin), so
only those become Python lists; every other bin stays a slice of ``flat``. A split bin keeps its place,
its second half is appended, exactly as :func:`split_fullest` does on lists.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from lit_seqpack._checks import check_int, check_optional_int, is_int
from lit_seqpack.planning import _kernels
from lit_seqpack.planning._sorting import decreasing_order as _decreasing
from lit_seqpack.planning._sorting import decreasing_runs as _decreasing_runs
from lit_seqpack.planning._sorting import dense_histogram as _dense_histogram
from lit_seqpack.planning._sorting import largest

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PACKING_ALGORITHMS",
    "Packer",
    "PackingAlgorithm",
    "get_packer",
    "pack_first",
    "packing_algorithm",
    "split_fullest",
    "split_fullest_flat",
]


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


# Best fit keeps O(capacity) memory up to this capacity, then switches to an O(n) structure.
DENSE_BEST_FIT_MAX_CAPACITY = 1 << 22


@dataclass(frozen=True, kw_only=True, slots=True)
class Packer:
    """A configured packing algorithm; build it with :func:`get_packer`.

    Args:
        algorithm: a name in :data:`ALGORITHMS` (case-insensitive; stored lower-case).
        capacity: the most tokens a bin may hold (>= 1).
        min_bin_count: produce at least this many bins (>= 0), splitting bins if needed.
        bin_count_multiple: make the bin count a multiple of this (>= 1).
        seed: seed of ``first_fit_shuffle``'s order (>= 0); ignored by the other algorithms.
    """

    algorithm: str
    capacity: int
    min_bin_count: int | None = None
    bin_count_multiple: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        name = self.algorithm.strip().lower() if isinstance(self.algorithm, str) else self.algorithm
        object.__setattr__(self, "algorithm", packing_algorithm(name).name)
        object.__setattr__(self, "capacity", check_int("capacity", self.capacity, minimum=1))
        object.__setattr__(self, "min_bin_count", check_optional_int("min_bin_count", self.min_bin_count, minimum=0))
        multiple = check_optional_int("bin_count_multiple", self.bin_count_multiple, minimum=1)
        object.__setattr__(self, "bin_count_multiple", multiple)
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))

    def pack(self, lengths: Sequence[int] | np.ndarray) -> list[list[int]]:
        """Pack sequences into bins.

        Args:
            lengths: token count of each sequence (integers in ``[0, capacity]``).

        Returns:
            Bins as lists of indices into ``lengths``; every index exactly once.

        Raises:
            ValueError: a length is negative, not an integer or above ``capacity`` (the message names
                the index, the length and the capacity), or the bin count cannot be reached.

        Example:
            >>> get_packer("first_fit_decreasing", 10).pack([6, 5, 4, 3, 2])
            [[0, 2], [1, 3, 4]]
        """
        return _as_lists(*self.pack_flat(lengths))

    def pack_flat(self, lengths: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bins of :meth:`pack` as flat arrays: bin ``b`` is ``flat[ends[b - 1]:ends[b]]``.

        No Python list per bin: a few bytes per sequence instead of ~40 for lists of ints.

        Example:
            >>> flat, ends = get_packer("first_fit_decreasing", 10).pack_flat([6, 5, 4, 3, 2])
            >>> flat.tolist(), ends.tolist()
            ([0, 2, 1, 3, 4], [2, 5])
        """
        sizes = _as_sizes(lengths, self.capacity)
        if sizes.shape[0] == 0:
            self._check_reachable(0, 0)
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order, bin_ids, fills = ALGORITHMS[self.algorithm].assign(sizes, self.capacity, self.seed)
        n_bins = int(bin_ids.max()) + 1
        flat, ends = _kernels.get_kernel("group_by_bin")(order, bin_ids, n_bins)
        target = self.target_bin_count(n_bins)
        if target > n_bins:
            self._check_reachable(target, sizes.shape[0])
            if fills is None:
                fills = np.bincount(bin_ids, weights=sizes[order], minlength=n_bins).astype(np.int64)
            del order, bin_ids
            flat, ends = split_fullest_flat(flat, ends, sizes, fills, target)
        return flat, ends

    def count_bins(self, lengths: Sequence[int] | np.ndarray) -> int:
        """Bins the algorithm itself makes (before ``min_bin_count`` and ``bin_count_multiple``).

        Example:
            >>> get_packer("first_fit_decreasing", 10, bin_count_multiple=4).count_bins([6, 5, 4, 3, 2])
            2
        """
        sizes = _as_sizes(lengths, self.capacity, keep_dtype=True)
        if sizes.shape[0] == 0:
            return 0
        if self.algorithm == "first_fit_decreasing":  # from the histogram: no sort, a few steps per bin
            run_sizes, run_counts = _decreasing_runs(sizes)
            return _first_fit_runs(run_sizes, run_counts, self.capacity, _NO_BINS)[0]
        sizes = sizes.astype(np.int64, copy=False)
        return int(ALGORITHMS[self.algorithm].assign(sizes, self.capacity, self.seed)[1].max()) + 1

    def target_bin_count(self, n_bins: int) -> int:
        """The final bin count when the algorithm made ``n_bins`` bins (see the module docstring)."""
        target = max(n_bins, self.min_bin_count or 0)
        multiple = self.bin_count_multiple or 1
        return -(-target // multiple) * multiple

    def _check_reachable(self, target: int, n_sequences: int) -> None:
        target = max(target, self.target_bin_count(0))
        if target > n_sequences:
            raise ValueError(
                f"Cannot create {target} bins with only {n_sequences} sequences (bins are never empty; "
                f"min_bin_count={self.min_bin_count}, bin_count_multiple={self.bin_count_multiple}, "
                f"algorithm={self.algorithm!r}, capacity={self.capacity})"
            )


def get_packer(
    algorithm: str,
    capacity: int,
    *,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
    seed: int = 0,
) -> Packer:
    """Build a :class:`Packer`; invalid arguments raise ``ValueError`` here, not at ``pack`` time.

    Example:
        >>> get_packer("Concatenative", 8).pack([5, 3, 4, 0, 4])
        [[0, 1], [2, 3, 4]]
    """
    return Packer(
        algorithm=algorithm,
        capacity=capacity,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
        seed=seed,
    )


def pack_first(
    lengths: Sequence[int] | np.ndarray, first: np.ndarray, algorithm: str, capacity: int, *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Flat bins (as :meth:`Packer.pack_flat`) of ``algorithm``, the sequences marked ``first`` placed before the rest.

    For best fit and first fit decreasing each group is taken longest first, so the last, least-full bins hold none
    of the ``first`` sequences: the streaming buffer packs the samples a window must train this way
    (:func:`~lit_seqpack.data.streaming.buffer.carried_over`). Other algorithms pack as :func:`get_packer`
    does (``seed``: ``first_fit_shuffle``'s order).

    Example:
        >>> flat, ends = pack_first([6, 5, 4, 3], np.array([False, False, False, True]), "best_fit_decreasing", 10)
        >>> flat.tolist(), ends.tolist()  # the 3 first: 3+6, then 5+4
        ([3, 0, 1, 2], [2, 4])
    """
    name = packing_algorithm(algorithm).name
    if name not in ("best_fit_decreasing", "first_fit_decreasing"):
        return get_packer(name, capacity, seed=seed).pack_flat(lengths)
    sizes = _as_sizes(lengths, capacity)
    if sizes.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort((-sizes, ~np.asarray(first, dtype=bool)))
    if name == "first_fit_decreasing":
        bin_ids = _first_fit_in(order, sizes, capacity)[1]
    else:
        kernel = "best_fit_dense" if capacity <= DENSE_BEST_FIT_MAX_CAPACITY else "best_fit_sorted"
        bin_ids = _kernels.get_kernel(kernel)(sizes[order], capacity)
    return _kernels.get_kernel("group_by_bin")(order, bin_ids, int(bin_ids.max()) + 1)


def _as_sizes(lengths: Sequence[int] | np.ndarray, capacity: int, *, keep_dtype: bool = False) -> np.ndarray:
    """Validate ``lengths``: a 1-D ``int64`` array (with ``keep_dtype``, integer arrays keep their dtype)."""
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {array.shape}")
    if array.dtype.kind in "iu":
        sizes = array if keep_dtype and array.dtype != np.uint64 else array.astype(np.int64, copy=False)
    elif array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"lengths[{i}] = {array[i].item()!r} is not an integer (capacity={capacity})")
        sizes = array.astype(np.int64)
    else:
        values = array.tolist()
        i = next((i for i, value in enumerate(values) if not is_int(value)), None)
        if i is not None:
            raise ValueError(f"lengths[{i}] = {values[i]!r} is not an integer (capacity={capacity})")
        sizes = np.array(values, dtype=np.int64).reshape(-1)
    if sizes.shape[0] == 0 or (int(sizes.min()) >= 0 and int(sizes.max()) <= capacity):
        return sizes
    bad = np.flatnonzero((sizes < 0) | (sizes > capacity))
    if bad.size:
        i = int(bad[0])
        problem = "is negative" if sizes[i] < 0 else "is above the capacity"
        raise ValueError(f"lengths[{i}] = {int(sizes[i])} {problem} (capacity={capacity})")
    return sizes


def _as_lists(flat: np.ndarray, ends: np.ndarray) -> list[list[int]]:
    """Bins as Python lists. The garbage collector is paused meanwhile: lists of ints hold no cycles, and
    its passes over the growing list of lists would double the time for a million sequences."""
    items, stops = flat.tolist(), ends.tolist()
    if not stops:
        return []
    bounds = zip([0, *stops[:-1]], stops, strict=True)
    collecting = gc.isenabled()
    gc.disable()
    try:
        return [items[start:end] for start, end in bounds]
    finally:
        if collecting:
            gc.enable()


_NO_BINS = np.zeros(0, np.int64)


# An assigner returns (processing order, bin of each position in that order, fill of each bin or None).
Assignment = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _concatenative(sizes: np.ndarray, capacity: int, seed: int) -> Assignment:
    return np.arange(sizes.shape[0]), _kernels.get_kernel("concatenative")(sizes, capacity), None


def _first_fit_in(order: np.ndarray, sizes: np.ndarray, capacity: int) -> Assignment:
    return order, _kernels.get_kernel("first_fit")(sizes[order], capacity, np.zeros(0, np.int64)), None


def _first_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int) -> Assignment:
    """First fit in decreasing order, placed run by run (``_kernels.first_fit_runs``: the same bins)."""
    histogram = _dense_histogram(sizes)
    run_sizes, run_counts = _decreasing_runs(sizes, histogram)
    bin_ids = np.empty(sizes.shape[0], np.int64)
    _, fills = _first_fit_runs(run_sizes, run_counts, capacity, bin_ids)
    return _decreasing(sizes, histogram), bin_ids, fills


def _first_fit_runs(
    run_sizes: np.ndarray, run_counts: np.ndarray, capacity: int, bins: np.ndarray
) -> tuple[int, np.ndarray]:
    """``_kernels.first_fit_runs``, on an ``int32`` room tree when the capacity fits one; ``int64`` fills."""
    name = "first_fit_runs_narrow" if capacity < 1 << 31 else "first_fit_runs"
    n_bins, fills = _kernels.get_kernel(name)(run_sizes, run_counts, capacity, bins)
    return int(n_bins), fills.astype(np.int64, copy=False)


def _first_fit_shuffle(sizes: np.ndarray, capacity: int, seed: int) -> Assignment:
    return _first_fit_in(np.random.default_rng(seed).permutation(sizes.shape[0]), sizes, capacity)


def _best_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int) -> Assignment:
    order = _decreasing(sizes)
    name = "best_fit_dense" if capacity <= DENSE_BEST_FIT_MAX_CAPACITY else "best_fit_sorted"
    return order, _kernels.get_kernel(name)(sizes[order], capacity), None


def _modified_first_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int) -> Assignment:
    order = _decreasing(sizes)
    desc = sizes[order]
    bin_ids, room = _kernels.get_kernel("mffd_large_bins")(desc, capacity)
    left = np.flatnonzero(bin_ids < 0)
    if left.size:
        bin_ids[left] = _kernels.get_kernel("first_fit")(desc[left], capacity, room)
    return order, bin_ids, None


Assigner = Callable[[np.ndarray, int, int], Assignment]
"""``assign(sizes, capacity, seed)``: the :data:`Assignment` of ``int64`` sizes, each in ``[0, capacity]``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingAlgorithm:
    """One packing algorithm: every table, docstring, default and error of the package reads its facts here.

    Args:
        name: the name users write (lower-case).
        assign: the assigner (see :data:`Assigner`): the processing order, the bin of each position in that
            order, and the fill of each bin (or ``None``).
        sort_based: processes the sequences longest first in a stable sort. Then the bin count does not depend
            on the input order (a plan counts a window in any order), and a single bin lists its sequences
            longest first (a rollout share that fits one row skips the packer).
        description: one line for docstrings and tables.
        default: the algorithm used when none is named (exactly one record has it).
    """

    name: str
    assign: Assigner
    sort_based: bool
    description: str
    default: bool = False


_RECORDS = (
    PackingAlgorithm(
        name="concatenative",
        assign=_concatenative,
        sort_based=False,
        description="input order; a new bin whenever the next sequence does not fit (next fit).",
    ),
    PackingAlgorithm(
        name="first_fit_decreasing",
        assign=_first_fit_decreasing,
        sort_based=True,
        description="longest first, each into the lowest-numbered bin with room.",
        default=True,
    ),
    PackingAlgorithm(
        name="first_fit_shuffle",
        assign=_first_fit_shuffle,
        sort_based=False,
        description="first fit in a random order drawn from ``numpy.random.default_rng(seed)`` (the global "
        "``random``/``numpy.random`` state is never read or changed).",
    ),
    PackingAlgorithm(
        name="modified_first_fit_decreasing",
        assign=_modified_first_fit_decreasing,
        sort_based=True,
        description="Johnson & Garey (1985): large items (> C/2) open one bin each, then mediums (> C/3), pairs "
        "of smalls (> C/6), a greedy fill with anything that fits, and first fit decreasing for the leftovers.",
    ),
    PackingAlgorithm(
        name="best_fit_decreasing",
        assign=_best_fit_decreasing,
        sort_based=True,
        description="longest first, each into the fullest bin that still has room (ties: the bin that reached "
        "that fill last).",
    ),
)


def _registry(records: Sequence[PackingAlgorithm]) -> Mapping[str, PackingAlgorithm]:
    """Records by name, checked: distinct lower-case names and exactly one default."""
    names = [record.name for record in records]
    if len(set(names)) != len(names) or any(name != name.strip().lower() for name in names):
        raise ValueError(f"packing algorithm names must be distinct and lower-case, got {names}")
    defaults = [record.name for record in records if record.default]
    if len(defaults) != 1:
        raise ValueError(f"exactly one packing algorithm must be the default, got {defaults}")
    return MappingProxyType({record.name: record for record in records})


ALGORITHMS: Mapping[str, PackingAlgorithm] = _registry(_RECORDS)
"""Every packing algorithm's record, by name."""
PACKING_ALGORITHMS: tuple[str, ...] = tuple(ALGORITHMS)
"""The names of :data:`ALGORITHMS`."""
DEFAULT_ALGORITHM: str = next(record.name for record in _RECORDS if record.default)
"""The algorithm used when none is named."""


def packing_algorithm(name: str | None = None) -> PackingAlgorithm:
    """The record of ``name`` (``None``: the default); an unknown name raises a ``ValueError`` listing the names.

    Example:
        >>> packing_algorithm().name, packing_algorithm("concatenative").sort_based
        ('first_fit_decreasing', False)
    """
    if name is None:
        return next(record for record in ALGORITHMS.values() if record.default)
    record = ALGORITHMS.get(name) if isinstance(name, str) else None
    if record is None:
        raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, got {name!r}")
    return record


if __doc__:  # None under python -OO
    _LISTED = "\n".join(f"- ``{record.name}``: {record.description}" for record in _RECORDS)
    __doc__ = f"{__doc__.rstrip()}\n\nAlgorithms (the default is ``{DEFAULT_ALGORITHM}``):\n\n{_LISTED}\n"
