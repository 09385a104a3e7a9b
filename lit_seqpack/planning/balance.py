"""Causal attention work per context-parallel (CP) rank: how evenly a split of packed rows loads the CP ranks.

Pure numpy (no torch). Under causal attention the query at position ``p`` of a sequence attends to ``p + 1``
keys, so a rank's work is the sum of ``p + 1`` over the positions it holds. Two splits of a packed row over
``cp`` ranks::

    zigzag      every document padded to a multiple of 2*cp, cut into 2*cp chunks;        (lit_seqpack, Megatron,
                rank r holds chunks r and 2*cp-1-r of every document                        Transformer Engine)
    contiguous  the row cut into cp consecutive pieces                                       (the naive split)

For one document of ``2 * cp * C`` tokens the zigzag pair of rank ``r`` costs ``C(rC + 1) + C(C - 1)/2 + C((2cp-1-r)C
+ 1) + C(C - 1)/2 = 2cp C^2 + C``, the same for every ``r``: the computed work is exactly balanced. Counting only
real tokens (``count="real"``), the padding at a document's end makes the rank holding the last chunk a little
lighter. The contiguous split gives the last rank of a long document about ``2cp - 1`` times the first's work.

Example:
    >>> causal_work_per_cp_rank([8], 2).tolist(), causal_work_per_cp_rank([8], 2, split="contiguous").tolist()
    ([18, 18], [10, 26])

Assign a window's microbatches to (optimizer step, rank, accumulation slot) so rank loads are even.

A window holds ``G = S x W x A`` microbatches (``S`` steps, ``W`` ranks, ``A`` accumulation slots). DDP
ranks only wait for each other at the gradient all-reduce of each optimizer step, so what must be even
is the total cost each rank runs *per step*. Two phases:

1. **Bundles.** Sort microbatches by cost (largest first) and deal them in snake order over the
   ``S x W`` bundles (one bundle = one rank's ``A`` microbatches of one step)::

       costs (sorted)  9 8 7 6 | 5 4 3 2      4 bundles, A = 2
       round 0 ->      b0 b1 b2 b3
       round 1 <-                  b3 b2 b1 b0     loads: b0 = 9+2, b1 = 8+3, b2 = 7+4, b3 = 6+5

2. **Steps.** Sort the bundles by load and give each step ``W`` consecutive bundles, so the ranks of a
   step carry near-equal loads even when ``A = 1`` (each bundle is then a single microbatch).

With ``rng`` given (shuffled plans), ties are broken at random inside cost buckets of 1/256 of the
largest cost, ranks within a step are permuted and the steps of the window are shuffled: which
microbatches share a step changes from epoch to epoch at a balance cost below 0.4 %.

Multiway number partitioning: split weighted items into ``k`` parts of near-equal sums (Karmarkar-Karp).

The largest differencing method keeps a heap of partial partitions, each ``k`` sums with their members. It
starts with one partition per item (the item alone in its first part) and repeatedly merges the two partitions
with the largest spread (max sum minus min sum), pairing the heaviest part of one with the lightest part of the
other, until one partition is left::

    costs 8 7 6 5 4, k = 2     (8|0) (7|0) (6|0) (5|0) (4|0)
    merge (8|0) + (7|0)   ->   (8|7)  spread 1
    merge (6|0) + (5|0)   ->   (6|5)  spread 1 ... down to (8+5+... | 7+6+...)

The merge loop is a kernel of :mod:`lit_seqpack.planning._kernels` (numba-compiled, the same statements in pure
Python without numba): partitions live in arrays (``k`` sums, and each part's members as a linked list, so a merge
joins two lists in O(1) instead of copying them), the heap is an array. Deterministic: ties of spread are broken
by creation order, ties of part sums by a stable sort; 4096 items into 64 parts take about a millisecond compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lit_seqpack._checks import check_int
from lit_seqpack.planning import _kernels
from lit_seqpack.planning._kernels import _jitable, _kernel, get_kernel

__all__ = [
    "CP_SPLITS",
    "causal_work_per_cp_rank",
    "cp_work_imbalance",
    "assign_slots",
    "bucketed_order",
    "order_within_bundles",
    "step_imbalance",
    "karmarkar_karp",
    "karmarkar_karp_parts",
]


_TIE_BUCKETS = 256


def _descending(values: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Order of ``values`` from largest to smallest; random among values of the same 1/256 bucket."""
    if rng is None:
        return np.argsort(-values, kind="stable")
    top = float(values.max()) if values.size else 0.0
    if top <= 0.0:
        return rng.permutation(values.size)
    bucket = np.floor(values * (_TIE_BUCKETS / top))
    return bucketed_order(bucket, rng.random(values.size))


def bucketed_order(bucket: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``np.lexsort((draws, -bucket))``: by decreasing ``bucket``, then increasing ``draws``, then index.

    ``draws`` are ``Generator.random`` floats, multiples of ``2**-53``; with a small ``bucket`` range both fit in
    one ``int64`` key, sorted by numpy's (vectorised, unstable) quicksort: 5-10x faster than ``lexsort``. Equal
    keys (equal draws in one bucket: rare) take the stable sort, so the order is exactly ``lexsort``'s.

    Example:
        >>> bucketed_order(np.array([1.0, 2.0, 1.0]), np.array([0.5, 0.25, 0.125])).tolist()
        [1, 2, 0]
    """
    if bucket.size == 0:
        return np.zeros(0, dtype=np.int64)
    key, fits = _kernels.get_kernel("bucket_keys")(np.asarray(bucket, np.float64), np.asarray(draws, np.float64))
    if not fits:
        return np.lexsort((draws, -bucket))
    order = np.argsort(key)
    ranked = key[order]
    if np.any(ranked[1:] == ranked[:-1]):
        return np.argsort(key, kind="stable")
    return order


def assign_slots(
    costs: np.ndarray, world_size: int, accumulate_grad_batches: int, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Place microbatches ``0..G-1`` into an ``[S, world_size, accumulate_grad_batches]`` grid.

    Args:
        costs: cost of each microbatch (``G`` values, ``G`` a multiple of ``world_size x accumulate``).
        world_size: number of ranks ``W``.
        accumulate_grad_batches: microbatches per rank per optimizer step ``A``.
        rng: randomises ties, ranks within a step and the order of steps; ``None`` is deterministic.

    Returns:
        ``slots[s, r, j]``: the microbatch rank ``r`` runs as its ``j``-th microbatch of step ``s``.

    Example:
        >>> assign_slots(np.array([9.0, 8, 7, 6, 5, 4, 3, 2]), 2, 2).tolist()
        [[[0, 7], [1, 6]], [[2, 5], [3, 4]]]
    """
    costs = np.asarray(costs, dtype=np.float64)
    slots_per_step = world_size * accumulate_grad_batches
    if costs.size % slots_per_step:
        raise ValueError(f"{costs.size} microbatches do not fill whole steps of {slots_per_step} slots")
    num_steps = costs.size // slots_per_step
    num_bundles = num_steps * world_size
    if num_steps == 0:
        return np.zeros((0, world_size, accumulate_grad_batches), dtype=np.int64)
    # phase 1: snake deal of the sorted microbatches over the bundles
    dealt = _descending(costs, rng).reshape(accumulate_grad_batches, num_bundles)
    dealt[1::2] = dealt[1::2, ::-1]
    bundles = dealt.T  # [num_bundles, A]
    # phase 2: bundles of similar load share a step
    loads = costs[bundles].sum(axis=1)
    grid = bundles[_descending(loads, rng)].reshape(num_steps, world_size, accumulate_grad_batches)
    if rng is not None:
        ranks = rng.permuted(np.tile(np.arange(world_size), (num_steps, 1)), axis=1)
        grid = grid[np.arange(num_steps)[:, None], ranks][rng.permutation(num_steps)]
    return np.ascontiguousarray(grid)


def order_within_bundles(slots: np.ndarray, costs: np.ndarray, microbatch_order: str) -> np.ndarray:
    """Order each rank's microbatches of a step, and (``largest_first``) the steps of the window.

    Args:
        slots: the ``[S, W, A]`` grid of :func:`assign_slots`.
        costs: cost of each microbatch.
        microbatch_order: ``"packer"`` keeps the packer's order (ascending microbatch id) within a
            rank's step; ``"largest_first"`` runs each rank's costliest microbatch of the step first
            and moves the step holding the window's costliest microbatch to the front, so the
            allocator meets the peak shape first (NeMo-RL does the same to limit fragmentation).

    Returns:
        The reordered grid (a new array).
    """
    if slots.size == 0:
        return slots.copy()
    if microbatch_order not in ("packer", "largest_first"):
        raise ValueError(f"microbatch_order must be 'packer' or 'largest_first', got {microbatch_order!r}")
    costs = np.asarray(costs, dtype=np.float64)
    by_cost = microbatch_order == "largest_first"
    # each rank's slots of a step: by id (np.sort) or by decreasing cost, ties in slot order (a stable argsort)
    grid = _kernels.get_kernel("sort_slots")(np.ascontiguousarray(slots, dtype=np.int64), costs, by_cost)
    if by_cost:
        first = int(np.argmax(costs[grid[:, :, 0]].max(axis=1)))  # slot 0 of each rank holds its costliest
        if first:
            grid[[0, first]] = grid[[first, 0]]
    return grid


def step_imbalance(tokens: np.ndarray, slots: np.ndarray) -> tuple[float, float]:
    """Mean and max over steps of max/mean of the tokens each rank runs in the step (1.0 with no step).

    Example:
        >>> mean, worst = step_imbalance(np.array([4, 2, 3, 3]), np.array([[[0], [1]], [[2], [3]]]))
        >>> round(mean, 4), round(worst, 4)  # step 0: 4 vs 2 -> 4/3; step 1: 3 vs 3 -> 1
        (1.1667, 1.3333)
    """
    per_slot = np.asarray(tokens)[slots]
    rank_tokens = per_slot[:, :, 0].astype(np.float64)  # integer sums slot by slot (exact, faster than sum(axis=2))
    for slot in range(1, per_slot.shape[2]):
        rank_tokens += per_slot[:, :, slot]
    means = rank_tokens.mean(axis=1)
    busy = means > 0
    ratios = rank_tokens.max(axis=1)[busy] / means[busy]
    return (float(ratios.mean()), float(ratios.max())) if ratios.size else (1.0, 1.0)


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
    assignment = karmarkar_karp_parts(costs, parts)
    order = np.argsort(assignment, kind="stable")
    bounds = np.searchsorted(assignment[order], np.arange(1, parts))
    return [part.tolist() for part in np.split(order, bounds)]


def karmarkar_karp_parts(costs: Sequence[float] | np.ndarray, parts: int) -> np.ndarray:
    """The part (``0`` heaviest .. ``parts - 1``) of every item, as :func:`karmarkar_karp` deals them.

    Example:
        >>> karmarkar_karp_parts([8, 7, 6, 5, 4], 2).tolist()
        [1, 0, 1, 0, 0]
    """
    values = np.ascontiguousarray(costs, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("costs must be a 1-D array of finite numbers >= 0")
    parts = check_int("parts", parts, minimum=1)
    if values.size == 0:
        return np.zeros(0, dtype=np.int64)
    return get_kernel("largest_differencing")(values, parts)


@_jitable
def _before(spread: np.ndarray, heap: np.ndarray, i: int, j: int) -> bool:
    """Heap order of entries ``i`` and ``j``: the larger spread first, then the earlier creation (smaller id)."""
    a, b = heap[i], heap[j]
    return spread[a] > spread[b] or (spread[a] == spread[b] and a < b)


@_jitable
def _heap_pop(spread: np.ndarray, heap: np.ndarray, size: int) -> int:
    """Remove the top of the heap of ``size`` partition ids (the caller reads ``heap[0]`` first)."""
    size -= 1
    heap[0] = heap[size]
    i = 0
    while 2 * i + 1 < size:
        child = 2 * i + 1
        if child + 1 < size and _before(spread, heap, child + 1, child):
            child += 1
        if not _before(spread, heap, child, i):
            break
        heap[i], heap[child] = heap[child], heap[i]
        i = child
    return size


@_jitable
def _heap_push(spread: np.ndarray, heap: np.ndarray, size: int, ident: int) -> int:
    heap[size] = ident
    i = size
    while i > 0 and _before(spread, heap, i, (i - 1) // 2):
        heap[i], heap[(i - 1) // 2] = heap[(i - 1) // 2], heap[i]
        i = (i - 1) // 2
    return size + 1


@_jitable
def _sort_decreasing(values: np.ndarray, order: np.ndarray) -> None:
    """``order`` becomes the indices of ``values`` by decreasing value, ties in index order (a stable insertion
    sort, allocating nothing)."""
    for i in range(values.shape[0]):
        order[i] = i
    for i in range(1, values.shape[0]):
        current = order[i]
        value = values[current]
        j = i - 1
        while j >= 0 and values[order[j]] < value:
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = current


@_jitable
def _stored(ident: int, n: int, order: np.ndarray, values: np.ndarray, slot_of: np.ndarray, scratch: int, pool) -> int:
    """The pool slot of partition ``ident``; an item alone is written into slot ``scratch`` first."""
    if ident >= n:
        return slot_of[ident - n]
    sums, heads, tails = pool
    sums[scratch, :] = 0.0
    heads[scratch, :] = -1
    tails[scratch, :] = -1
    sums[scratch, 0] = values[order[ident]]
    heads[scratch, 0] = order[ident]
    tails[scratch, 0] = order[ident]
    return scratch


@_kernel
def largest_differencing(values: np.ndarray, parts: int) -> np.ndarray:
    """The part of every item after Karmarkar-Karp's largest differencing (see the module docstring).

    Partitions are numbered in creation order: ``k < n`` is the ``k``-th heaviest item alone in its first part,
    ``n + m`` the ``m``-th merge. A merge is stored in a pool slot: its part sums in decreasing order, and each
    part's members as a linked list (``heads``, ``tails`` and every item's ``following`` member); an item alone is
    copied into one of two scratch slots when it is merged.
    """
    n = values.shape[0]
    order = np.argsort(-values, kind="mergesort")
    pool = n // 2 + 3  # merged partitions alive at once hold >= 2 items each; the last two slots are scratch
    sums = np.zeros((pool, parts))
    heads = np.full((pool, parts), -1, np.int64)
    tails = np.full((pool, parts), -1, np.int64)
    slot_of = np.full(max(n - 1, 1), -1, np.int64)
    free = np.arange(pool - 3, -1, -1)
    n_free = pool - 2
    following = np.full(n, -1, np.int64)
    spread = np.empty(2 * n - 1)
    heap = np.arange(n)  # sorted by spread, then creation: already a heap
    spread[:n] = values[order]
    size = n
    merged = np.empty(parts)
    rank = np.empty(parts, np.int64)
    new_heads = np.empty(parts, np.int64)
    new_tails = np.empty(parts, np.int64)
    for created in range(n, 2 * n - 1):
        first = heap[0]
        size = _heap_pop(spread, heap, size)
        second = heap[0]
        size = _heap_pop(spread, heap, size)
        a = _stored(first, n, order, values, slot_of, pool - 2, (sums, heads, tails))
        b = _stored(second, n, order, values, slot_of, pool - 1, (sums, heads, tails))
        for j in range(parts):  # the heaviest part of one with the lightest of the other
            merged[j] = sums[a, j] + sums[b, parts - 1 - j]
        _sort_decreasing(merged, rank)
        for j in range(parts):
            src = rank[j]
            head, tail = heads[a, src], tails[a, src]
            other_head = heads[b, parts - 1 - src]
            if head < 0:
                head, tail = other_head, tails[b, parts - 1 - src]
            elif other_head >= 0:
                following[tail] = other_head
                tail = tails[b, parts - 1 - src]
            new_heads[j], new_tails[j] = head, tail
        for slot in (a, b):
            if slot < pool - 2:
                free[n_free] = slot
                n_free += 1
        n_free -= 1
        slot = free[n_free]
        slot_of[created - n] = slot
        for j in range(parts):
            sums[slot, j], heads[slot, j], tails[slot, j] = merged[rank[j]], new_heads[j], new_tails[j]
        spread[created] = sums[slot, 0] - sums[slot, parts - 1]
        size = _heap_push(spread, heap, size, created)
    assignment = np.zeros(n, np.int64)
    if n > 1:
        for j in range(parts):
            item = heads[slot_of[heap[0] - n], j]
            while item >= 0:
                assignment[item] = j
                item = following[item]
    return assignment


CP_SPLITS: tuple[str, ...] = ("zigzag", "contiguous")
"""Ways of splitting a packed row over CP ranks that :func:`causal_work_per_cp_rank` measures."""


def _lengths(name: str, values: object) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D sequence of ints, got {values!r:.80}")
    array = array.astype(np.int64)
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0, got {array.tolist()!r:.80}")
    return array


def _triangle(n: np.ndarray) -> np.ndarray:
    """Work of the causal queries at positions ``0 .. n - 1`` of a sequence: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


def _range_work(lo: np.ndarray, hi: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Work of the queries at positions ``[lo, hi)`` below ``limit`` of each sequence (element-wise)."""
    return _triangle(np.minimum(hi, limit)) - _triangle(np.minimum(lo, limit))


def _row_work(real: np.ndarray, cp: int, split: str, multiple: int, count: str) -> np.ndarray:
    """``[cp]`` work of one packed row of documents with ``real`` lengths."""
    if split == "zigzag":
        padded = -(-real // multiple) * multiple
        chunk = padded // (2 * cp)
        limit = real if count == "real" else padded
        ranks = np.arange(cp)[:, None]
        first = _range_work(ranks * chunk, (ranks + 1) * chunk, limit)
        second = _range_work((2 * cp - 1 - ranks) * chunk, (2 * cp - ranks) * chunk, limit)
        return (first + second).sum(axis=1)
    total = int(real.sum())
    padded_total = -(-total // cp) * cp
    segments = np.append(real, padded_total - total)  # the padding tail is computed like a sequence
    limit = np.append(real, 0) if count == "real" else segments
    starts = np.concatenate([[0], np.cumsum(segments)[:-1]])
    piece = padded_total // cp
    bounds = np.arange(cp + 1)[:, None] * piece - starts  # rank r holds [bounds[r], bounds[r + 1]) of each segment
    clipped = np.clip(bounds, 0, segments)
    return _range_work(clipped[:-1], clipped[1:], limit).sum(axis=1)


def causal_work_per_cp_rank(
    lengths_or_bins: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    cp_size: int,
    *,
    split: str = "zigzag",
    document_multiple: int | None = None,
    count: str = "computed",
) -> np.ndarray:
    """Causal attention work (query-key pairs) of every CP rank, for one packed row or for each of many.

    Args:
        lengths_or_bins: the real lengths of the documents of one packed row, or a sequence of rows (bins, e.g.
            the microbatches of a plan: ``[[lengths[i] for i in mb] for mb in plan.rank_microbatches(0)]``).
        cp_size: context-parallel ranks.
        split: ``"zigzag"`` (chunks ``r`` and ``2 cp - 1 - r`` of every document) or ``"contiguous"`` (the row
            cut into ``cp`` consecutive pieces, the row padded at its end to a multiple of ``cp``).
        document_multiple: zigzag pads every document to a multiple of this (default ``2 * cp_size``; it must
            be a multiple of ``2 * cp_size``).
        count: ``"computed"`` counts every position the kernel computes (padding included); ``"real"`` counts
            real queries only (each attends to real keys only, padding sits at the ends).

    Returns:
        ``int64`` work of shape ``[cp]`` for one row, ``[num_rows, cp]`` for rows.

    Example:
        >>> causal_work_per_cp_rank([[6, 2], [4]], 2).tolist()
        [[23, 23], [5, 5]]
    """
    cp = check_int("cp_size", cp_size, minimum=1)
    if split not in CP_SPLITS:
        raise ValueError(f"split must be one of {CP_SPLITS}, got {split!r}")
    if count not in ("computed", "real"):
        raise ValueError(f"count must be 'computed' or 'real', got {count!r}")
    multiple = 2 * cp if document_multiple is None else check_int("document_multiple", document_multiple, minimum=1)
    if multiple % (2 * cp):
        raise ValueError(f"document_multiple={multiple} must be a multiple of 2 x cp_size = {2 * cp}")
    if isinstance(lengths_or_bins, np.ndarray):
        is_rows = lengths_or_bins.ndim == 2
    else:
        is_rows = any(isinstance(row, (Sequence, np.ndarray)) for row in lengths_or_bins)
    if not is_rows:
        return _row_work(_lengths("lengths", lengths_or_bins), cp, split, multiple, count)
    rows = [_row_work(_lengths(f"bins[{i}]", row), cp, split, multiple, count) for i, row in enumerate(lengths_or_bins)]
    return np.stack(rows) if rows else np.zeros((0, cp), dtype=np.int64)


def cp_work_imbalance(work: np.ndarray) -> np.ndarray | float:
    """``max / mean`` of the per-rank work of each row (1.0 is perfect balance; a row without work counts 1.0).

    Example:
        >>> cp_work_imbalance(np.array([[10, 26], [5, 5]])).tolist()
        [1.4444444444444444, 1.0]
    """
    work = np.asarray(work, dtype=np.float64)
    if work.ndim not in (1, 2) or work.shape[-1] == 0:
        raise ValueError(f"work must be [cp] or [rows, cp], got shape {work.shape}")
    mean = work.mean(axis=-1)
    ratio = np.divide(work.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)
    return float(ratio) if work.ndim == 1 else ratio
