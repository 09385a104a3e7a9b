"""Hot loops of the packers: numba-compiled, with the very same code as the pure-Python fallback.

Backend selection (this module owns it):

- Every kernel is plain Python written in the subset numba compiles. When ``numba`` imports, each
  public kernel is wrapped in ``numba.njit(cache=True)``: it is compiled on first use and the machine
  code is cached on disk (next to this file, or under ``NUMBA_CACHE_DIR``), so later processes skip the
  compile. Helpers are ``register_jitable``: inlined into compiled callers, plain Python otherwise.
- When ``numba`` cannot be imported, or the environment variable ``LIT_SEQPACK_DISABLE_NUMBA`` is
  ``1``/``true``/``yes``/``on`` (read at every call, so tests can flip it), :func:`get_kernel` returns the
  uncompiled functions. Both paths run the same statements, so they give identical bins; the fallback
  is only slower (0.4-3 s per 100k items instead of milliseconds; still O(n log n)).

Conventions shared by every kernel: ``sizes`` is an ``int64`` array of item lengths in the order the
algorithm processes them, every size is in ``[0, capacity]``, and the result is the bin id of each
position (bins are numbered in the order they are opened, from 0).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import numba
    from numba.extending import register_jitable as _jitable
except ImportError:  # tested by blocking the import in a subprocess
    numba = None

    def _jitable(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn


NUMBA_AVAILABLE: bool = numba is not None
DISABLE_ENV_VAR = "LIT_SEQPACK_DISABLE_NUMBA"
_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def numba_enabled() -> bool:
    """Whether kernels run compiled: numba is importable and ``LIT_SEQPACK_DISABLE_NUMBA`` is not set."""
    flag = os.environ.get(DISABLE_ENV_VAR, "").strip().lower()
    return NUMBA_AVAILABLE and flag not in {"1", "true", "yes", "on"}


def _kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register ``fn`` as a kernel (compiled lazily when numba is present); returns ``fn`` unchanged."""
    compiled = fn
    if NUMBA_AVAILABLE:
        try:
            compiled = numba.njit(cache=True)(fn)
        except RuntimeError:  # no writable cache location: compile in every process instead
            compiled = numba.njit(fn)
    _KERNELS[fn.__name__] = (compiled, fn)
    return fn


def get_kernel(name: str) -> Callable[..., Any]:
    """The kernel called ``name``: compiled when :func:`numba_enabled`, the pure-Python one otherwise."""
    compiled, python = _KERNELS[name]
    return compiled if numba_enabled() else python


@_jitable
def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@_kernel
def concatenative(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Next fit in input order: open a new bin whenever the item does not fit the current one."""
    bins = np.empty(sizes.shape[0], np.int64)
    current = 0
    used = 0
    for k in range(sizes.shape[0]):
        if used + sizes[k] > capacity:
            current += 1
            used = 0
        used += sizes[k]
        bins[k] = current
    return bins


@_kernel
def first_fit(sizes: np.ndarray, capacity: int, initial_remaining: np.ndarray) -> np.ndarray:
    """First fit: each item goes to the lowest-numbered bin with room, in O(log n) per item.

    A segment tree over bins stores the largest remaining capacity of each subtree; bins not opened yet
    hold ``capacity``, so the leftmost leaf that fits is either an open bin or the next new one. Bins
    ``0 .. len(initial_remaining) - 1`` already exist with the given remaining capacities.
    """
    n = sizes.shape[0]
    n_initial = initial_remaining.shape[0]
    # Of the bins first fit opens, all but one end more than half full (an item opens a bin only when it
    # did not fit an earlier one), so fewer than 2 * total / capacity + 1 are opened: a smaller tree.
    total = 0
    for k in range(n):
        total += sizes[k]
    p = _pow2_at_least(n_initial + min(n, 2 * total // capacity + 2))
    tree = np.full(2 * p, capacity, np.int64)
    tree[p : p + n_initial] = initial_remaining
    for node in range(p - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bins = np.empty(n, np.int64)
    for k in range(n):
        size = sizes[k]
        node = 1
        while node < p:
            node *= 2
            if tree[node] < size:
                node += 1
        bins[k] = node - p
        tree[node] -= size
        node //= 2
        while node >= 1:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2
    return bins


@_jitable
def _refresh_range(tree: np.ndarray, p: int, first: int, last: int) -> None:
    """Recompute the maxima above leaves ``first .. last`` (inclusive) of a max segment tree."""
    lo = (p + first) // 2
    hi = (p + last) // 2
    while lo >= 1:
        for node in range(lo, hi + 1):
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
        lo //= 2
        hi //= 2


@_kernel
def first_fit_runs(
    run_sizes: np.ndarray, run_counts: np.ndarray, capacity: int, bins: np.ndarray
) -> tuple[int, np.ndarray]:
    """:func:`_first_fit_runs` with an ``int64`` tree of remaining room (any capacity)."""
    return _first_fit_runs(run_sizes, run_counts, capacity, bins, np.zeros(0, np.int64))


@_kernel
def first_fit_runs_narrow(
    run_sizes: np.ndarray, run_counts: np.ndarray, capacity: int, bins: np.ndarray
) -> tuple[int, np.ndarray]:
    """:func:`_first_fit_runs` with an ``int32`` tree (capacity below ``2**31``): half the memory traffic."""
    return _first_fit_runs(run_sizes, run_counts, capacity, bins, np.zeros(0, np.int32))


@_jitable
def _first_fit_runs(
    run_sizes: np.ndarray, run_counts: np.ndarray, capacity: int, bins: np.ndarray, room_like: np.ndarray
) -> tuple[int, np.ndarray]:
    """First fit over runs of equal items (``run_counts[r]`` items of ``run_sizes[r]``, in that order).

    The same bins as :func:`first_fit` on the expanded items, in O(log b) per *placement* rather than per
    item: the first bin with room for an item of a run takes ``min(left, room // size)`` of them at once
    (the items after it would go there too), and a run that opens bins fills ``capacity // size`` items
    into each. A placement either ends its run or leaves its bin too full for the run's size, so
    decreasing sizes (first fit decreasing from a histogram) need a few placements per bin, not one per
    item. Returns the bin count and each bin's fill; when ``bins`` has one entry per item it receives
    each item's bin (items in run order), when it is empty nothing is written (counting only). The tree of
    remaining room (and the fills) have ``room_like``'s dtype.
    """
    total = 0
    n = 0
    for r in range(run_sizes.shape[0]):
        total += run_sizes[r] * run_counts[r]
        n += run_counts[r]
    assign = bins.shape[0] > 0
    p = _pow2_at_least(min(n, 2 * total // capacity + 2) + 1)
    tree = np.full(2 * p, capacity, room_like.dtype)
    n_bins = 0
    item = 0
    for r in range(run_sizes.shape[0]):
        size = run_sizes[r]
        left = run_counts[r]
        if size == 0 and left > 0:  # an empty item fits the first bin, whatever its room
            n_bins = max(n_bins, 1)
            if assign:
                bins[item : item + left] = 0
            item += left
            continue
        while left > 0:
            node = 1
            while node < p:
                node *= 2
                if tree[node] < size:
                    node += 1
            b = node - p
            if b < n_bins:  # an open bin with room: it takes as many as fit
                take = min(left, tree[node] // size)
                tree[node] -= take * size
                node //= 2
                while node >= 1:  # the maxima above it, until one does not change
                    best = max(tree[2 * node], tree[2 * node + 1])
                    if tree[node] == best:
                        break
                    tree[node] = best
                    node //= 2
                if assign:
                    bins[item : item + take] = b
                item += take
                left -= take
                continue
            per_bin = capacity // size  # no open bin fits: new bins, each filled with this run
            opened = -(-left // per_bin)
            for k in range(opened):
                take = min(left, per_bin)
                tree[p + n_bins + k] = capacity - take * size
                if assign:
                    bins[item : item + take] = n_bins + k
                item += take
                left -= take
            _refresh_range(tree, p, n_bins, n_bins + opened - 1)
            n_bins += opened
    return n_bins, capacity - tree[p : p + n_bins]


@_kernel
def segment_figures(
    window_lengths: np.ndarray,
    loss_tokens: np.ndarray,
    positions: np.ndarray,
    local: np.ndarray,
    bounds: np.ndarray,
    a: float,
    b: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per segment ``local[bounds[m]:bounds[m + 1]]`` of a window: tokens, loss tokens, ``sum(a*L + b*L^2)``, longest.

    Item ``j`` of the window has length ``window_lengths[j]`` and dataset index ``positions[j]`` (``j`` itself
    when ``positions`` is empty); its loss tokens are ``loss_tokens[index]``, or ``max(length - 1, 0)`` when
    ``loss_tokens`` is empty. Also returns the dataset index of every member. One pass over the members, no
    per-member temporaries; sums run in member order (the same floats compiled or not).
    """
    count = bounds.shape[0] - 1
    identity = positions.shape[0] == 0
    default_loss = loss_tokens.shape[0] == 0
    members = np.empty(local.shape[0], np.int64)
    tokens = np.empty(count, np.int64)
    loss = np.empty(count, np.int64)
    cost = np.empty(count, np.float64)
    longest = np.empty(count, np.int64)
    for m in range(count):
        total = np.int64(0)
        targets = np.int64(0)
        weight = 0.0
        top = np.int64(0)
        for k in range(bounds[m], bounds[m + 1]):
            j = local[k]
            i = np.int64(j) if identity else np.int64(positions[j])
            members[k] = i
            length = np.int64(window_lengths[j])
            total += length
            targets += max(length - 1, 0) if default_loss else np.int64(loss_tokens[i])
            weight += a * float(length) + b * (float(length) * float(length))
            top = max(top, length)
        tokens[m] = total
        loss[m] = targets
        cost[m] = weight
        longest[m] = top
    return members, tokens, loss, cost, longest


@_kernel
def gather(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[index]``, any integer index dtype."""
    out = np.empty(index.shape[0], values.dtype)
    for k in range(index.shape[0]):
        out[k] = values[index[k]]
    return out


@_kernel
def bucket_keys(bucket: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(max(bucket) - bucket) << 53 | draws * 2**53`` as ``int64`` keys, and whether every value fits exactly.

    Ascending keys order by decreasing bucket, then increasing draw. They fit when every bucket is an integer at
    most 1023 below the largest and every draw a multiple of ``2**-53`` in ``[0, 1)`` (``Generator.random``'s);
    otherwise the second value is ``False`` and the keys are not to be used.
    """
    n = bucket.shape[0]
    key = np.empty(n, np.int64)
    high = bucket[0] if n else 0.0
    for k in range(n):
        high = max(high, bucket[k])
    scale = float(1 << 53)
    for k in range(n):
        spread = high - bucket[k]
        ticks = draws[k] * scale
        if not (0.0 <= spread < 1024.0 and spread == np.floor(spread) and 0.0 <= ticks < scale):
            return key, False
        if ticks != np.floor(ticks):
            return key, False
        key[k] = (np.int64(spread) << 53) | np.int64(ticks)
    return key, True


@_kernel
def sort_slots(slots: np.ndarray, costs: np.ndarray, by_cost: bool) -> np.ndarray:
    """Each ``slots[s, r, :]`` sorted: by decreasing ``costs`` (ties keep their order) or by increasing id.

    An insertion sort per row (rows hold ``accumulate_grad_batches`` slots: a handful); returns a new array.
    """
    out = slots.copy()
    for s in range(out.shape[0]):
        for r in range(out.shape[1]):
            for i in range(1, out.shape[2]):
                item = out[s, r, i]
                j = i
                while j > 0 and ((costs[out[s, r, j - 1]] < costs[item]) if by_cost else (out[s, r, j - 1] > item)):
                    out[s, r, j] = out[s, r, j - 1]
                    j -= 1
                out[s, r, j] = item
    return out


@_kernel
def greedy_group_sizes(rows_at: np.ndarray) -> np.ndarray:
    """Dynamic batching's groups: from position ``i`` a group takes ``rows_at[i]`` rows (fewer at the end).

    ``rows_at[i] >= 1`` is how many rows fit the budget when row ``i`` is the group's longest. Returns the row
    count of each group, in order.
    """
    n = rows_at.shape[0]
    sizes = np.empty(n, np.int64)
    count = 0
    i = 0
    while i < n:
        take = min(rows_at[i], n - i)
        sizes[count] = take
        count += 1
        i += take
    return sizes[:count].copy()


@_kernel
def decreasing_order(sizes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Counting sort: positions by decreasing size, equal sizes in index order (a stable sort).

    ``starts[v]`` is the first output position of size ``v``: the number of items larger than ``v``.
    """
    fill = starts.copy()
    order = np.empty(sizes.shape[0], np.int64)
    for k in range(sizes.shape[0]):
        v = sizes[k]
        order[fill[v]] = k
        fill[v] += 1
    return order


@_jitable
def _first_nonempty_at_least(count: np.ndarray, p: int, x: int) -> int:
    """Smallest leaf index ``>= x`` whose count is positive in a sum segment tree, or -1."""
    node = p + x
    if count[node] > 0:
        return x
    while node > 1:
        if node % 2 == 0 and count[node + 1] > 0:
            node += 1
            while node < p:
                node *= 2
                if count[node] == 0:
                    node += 1
            return node - p
        node //= 2
    return -1


@_jitable
def _tree_add(count: np.ndarray, p: int, leaf: int, delta: int) -> None:
    node = p + leaf
    while node >= 1:
        count[node] += delta
        node //= 2


@_kernel
def best_fit_dense(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Best fit in O(log capacity) per item, with O(capacity) memory.

    Bins are kept in one stack per remaining capacity (``head``/``below``) and a sum segment tree over
    remaining capacities finds the tightest non-empty level ``>= size``. Among bins with the same
    remaining capacity the one that reached it last is chosen (LIFO), exactly like :func:`best_fit_sorted`.
    """
    n = sizes.shape[0]
    p = _pow2_at_least(capacity + 1)
    count = np.zeros(2 * p, np.int32)
    head = np.full(capacity + 1, -1, np.int32)
    below = np.empty(n, np.int32)
    bins = np.empty(n, np.int64)
    n_bins = 0
    for k in range(n):
        size = sizes[k]
        level = _first_nonempty_at_least(count, p, size)
        if level < 0:
            b = n_bins
            n_bins += 1
            level = capacity
        else:
            b = head[level]
            head[level] = below[b]
            _tree_add(count, p, level, -1)
        level -= size
        below[b] = head[level]
        head[level] = b
        _tree_add(count, p, level, 1)
        bins[k] = b
    return bins


@_jitable
def _lower_bound(keys: np.ndarray, m: int, x: int) -> int:
    """First position in the ascending ``keys[:m]`` whose value is ``>= x`` (``m`` if none)."""
    lo = 0
    hi = m
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_kernel
def best_fit_sorted(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Best fit with O(n) memory (for huge capacities): open bins in an array sorted by remaining room.

    O(log b + b) per item for b open bins, which is cheap exactly when the capacity is huge (few bins).
    A bin re-enters in front of the bins with equal room, so ties go to the most recent (LIFO).
    """
    n = sizes.shape[0]
    keys = np.empty(n, np.int64)
    ids = np.empty(n, np.int64)
    bins = np.empty(n, np.int64)
    m = 0
    n_bins = 0
    for k in range(n):
        size = sizes[k]
        pos = _lower_bound(keys, m, size)
        if pos == m:
            b = n_bins
            n_bins += 1
            room = capacity - size
        else:
            b = ids[pos]
            room = keys[pos] - size
            keys[pos : m - 1] = keys[pos + 1 : m].copy()
            ids[pos : m - 1] = ids[pos + 1 : m].copy()
            m -= 1
        pos = _lower_bound(keys, m, room)
        keys[pos + 1 : m + 1] = keys[pos:m].copy()
        ids[pos + 1 : m + 1] = ids[pos:m].copy()
        keys[pos] = room
        ids[pos] = b
        m += 1
        bins[k] = b
    return bins


@_kernel
def group_by_bin(order: np.ndarray, bins: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counting sort of ``order`` by bin (stable): the items of bin ``b`` are ``flat[ends[b-1]:ends[b]]``."""
    ends = np.zeros(n_bins, np.int64)
    for k in range(bins.shape[0]):
        ends[bins[k]] += 1
    for b in range(1, n_bins):
        ends[b] += ends[b - 1]
    fill = np.zeros(n_bins, np.int64)
    for b in range(1, n_bins):
        fill[b] = ends[b - 1]
    flat = np.empty(bins.shape[0], np.int64)
    for k in range(bins.shape[0]):
        flat[fill[bins[k]]] = order[k]
        fill[bins[k]] += 1
    return flat, ends


@_jitable
def _find(parent: np.ndarray, i: int) -> int:
    """Union-find root with path compression (used as "next unused position" pointers)."""
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:
        up = parent[i]
        parent[i] = root
        i = up
    return root


@_jitable
def _largest_fitting(desc: np.ndarray, unused: np.ndarray, room: int, lo: int, hi: int) -> int:
    """Position of the largest unused item of ``desc[lo:hi]`` not above ``room`` (-1 if none)."""
    left = 0
    right = desc.shape[0]
    while left < right:
        mid = (left + right) // 2
        if desc[mid] > room:
            left = mid + 1
        else:
            right = mid
    j = _find(unused, max(left, lo))
    return j if j < hi else -1


@_jitable
def _place(
    j: int, b: int, desc: np.ndarray, bins: np.ndarray, room: np.ndarray, nxt: np.ndarray, prv: np.ndarray
) -> None:
    bins[j] = b
    room[b] -= desc[j]
    nxt[j] = j + 1
    prv[j + 1] = j


@_kernel
def mffd_large_bins(desc: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-4 of Johnson & Garey's modified first fit decreasing (the caller runs step 5).

    ``desc`` is non-increasing. Classes: large (> C/2), medium (> C/3), small (> C/6), tiny (the rest).
    1. one bin per large item; 2. forward over those bins, add the largest medium that fits;
    3. backward over the bins without a medium, if the two smallest smalls fit, add the smallest small
    and the largest small that still fits; 4. forward over the bins, add the largest remaining item that
    fits until none does. Returns the bin of each position (-1: left for first fit) and each bin's room.
    ``nxt``/``prv`` are union-find pointers to the next unused position at or after / before ``i``.
    """
    n = desc.shape[0]
    n_large = 0
    while n_large < n and 2 * desc[n_large] > capacity:
        n_large += 1
    medium_end = n_large
    while medium_end < n and 3 * desc[medium_end] > capacity:
        medium_end += 1
    small_end = medium_end
    while small_end < n and 6 * desc[small_end] > capacity:
        small_end += 1
    nxt = np.arange(n + 1)
    prv = np.arange(n + 1)
    bins = np.full(n, -1, np.int64)
    room = np.full(n_large, capacity, np.int64)
    for b in range(n_large):
        _place(b, b, desc, bins, room, nxt, prv)
    has_medium = np.zeros(n_large, np.bool_)
    for b in range(n_large):
        j = _largest_fitting(desc, nxt, room[b], n_large, medium_end)
        if j >= 0:
            _place(j, b, desc, bins, room, nxt, prv)
            has_medium[b] = True
    for b in range(n_large - 1, -1, -1):
        smallest = _find(prv, small_end) - 1
        second = _find(prv, smallest) - 1 if smallest >= medium_end else -1
        if second < medium_end:
            break
        if has_medium[b] or desc[smallest] + desc[second] > room[b]:
            continue
        _place(smallest, b, desc, bins, room, nxt, prv)
        j = _largest_fitting(desc, nxt, room[b], medium_end, small_end)
        _place(j, b, desc, bins, room, nxt, prv)
    for b in range(n_large):
        j = _largest_fitting(desc, nxt, room[b], n_large, n)
        while j >= 0:
            _place(j, b, desc, bins, room, nxt, prv)
            j = _largest_fitting(desc, nxt, room[b], n_large, n)
    return bins, room
