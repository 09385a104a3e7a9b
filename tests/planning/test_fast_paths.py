"""The planner's fast paths give exactly what the straightforward code they replaced gave.

Each reference below is the code that ran before (a lexsort, a heap over every group, numpy sorts, a separate
``loss_tokens`` array); the fast path must return the same arrays, so plans stay bit for bit the same.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning import _kernels
from lit_seqpack.planning._sorting import largest
from lit_seqpack.planning._windows import microbatch_figures
from lit_seqpack.planning.balance import bucketed_order, order_within_bundles
from lit_seqpack.planning.config import PlanConfig
from lit_seqpack.planning.dynamic import dynamic_group_sizes


def _split_to_multiple_reference(sizes: list[int], multiple: int) -> list[int]:
    """The heap over every group that dynamic batching used before."""
    missing = (-len(sizes)) % multiple
    if missing == 0:
        return sizes
    parts = [1] * len(sizes)
    heap = [(-s, g) for g, s in enumerate(sizes) if s >= 2]
    heapq.heapify(heap)
    while missing and heap:
        _, g = heapq.heappop(heap)
        parts[g] += 1
        missing -= 1
        if parts[g] < sizes[g]:
            heapq.heappush(heap, (-sizes[g] // parts[g], g))
    out: list[int] = []
    for s, p in zip(sizes, parts, strict=True):
        base, extra = divmod(s, p)
        out.extend([base + 1] * extra + [base] * (p - extra))
    return out + [0] * missing


def _dynamic_reference(sorted_lengths: np.ndarray, max_tokens: int, multiple: int) -> list[int]:
    rows_at = max_tokens // np.maximum(sorted_lengths, 1)
    sizes, i = [], 0
    while i < sorted_lengths.size:
        take = min(int(rows_at[i]), sorted_lengths.size - i)
        sizes.append(take)
        i += take
    return _split_to_multiple_reference(sizes, multiple)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 64), max_size=200),
    max_tokens=st.integers(64, 300),
    multiple=st.integers(1, 40),
)
def test_dynamic_group_sizes_equal_the_heap_over_every_group(lengths, max_tokens, multiple):
    sorted_lengths = np.sort(np.array(lengths, dtype=np.int64))[::-1]
    sizes = dynamic_group_sizes(sorted_lengths, max_tokens, group_count_multiple=multiple)
    assert sizes.dtype == np.int64
    assert sizes.tolist() == _dynamic_reference(sorted_lengths, max_tokens, multiple)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(0, 6), max_size=60),
    count=st.integers(0, 70),
    data=st.data(),
)
def test_largest_equals_a_lexsort(values, count, data):
    values = np.array(values, dtype=np.int64)
    candidates = np.array(sorted(data.draw(st.sets(st.integers(0, max(len(values) - 1, 0))))), dtype=np.int64)
    candidates = candidates[candidates < values.size]
    expected = np.sort(candidates[np.lexsort((candidates, -values[candidates]))][:count])
    assert largest(values, candidates, count).tolist() == expected.tolist()


@settings(max_examples=200, deadline=None)
@given(
    buckets=st.lists(st.integers(0, 256), min_size=1, max_size=300),
    seed=st.integers(0, 2**32 - 1),
    tie_every=st.integers(0, 5),
)
def test_bucketed_order_equals_a_lexsort(buckets, seed, tie_every):
    bucket = np.array(buckets, dtype=np.float64)
    draws = np.random.default_rng(seed).random(bucket.size)
    if tie_every:  # equal draws inside a bucket: the stable path
        draws[::tie_every] = draws[0]
    assert bucketed_order(bucket, draws).tolist() == np.lexsort((draws, -bucket)).tolist()


def test_bucketed_order_falls_back_on_draws_that_are_not_53_bit_multiples():
    bucket = np.array([1.0, 1.0, 0.0, 1.0])
    draws = np.array([0.3, 1e-300, 0.2, 0.1])  # 1e-300 is no multiple of 2**-53
    assert bucketed_order(bucket, draws).tolist() == np.lexsort((draws, -bucket)).tolist() == [1, 3, 0, 2]


@pytest.mark.parametrize("numba_off", [False, True])
def test_order_within_bundles_equals_the_numpy_sorts(numba_off, monkeypatch):
    if numba_off:
        monkeypatch.setenv(_kernels.DISABLE_ENV_VAR, "1")
    rng = np.random.default_rng(0)
    slots = rng.permutation(6 * 3 * 4).reshape(6, 3, 4)
    costs = rng.integers(0, 5, slots.size).astype(np.float64)  # many ties
    assert order_within_bundles(slots, costs, "packer").tolist() == np.sort(slots, axis=2).tolist()
    slot_costs = costs[slots]
    expected = np.take_along_axis(slots, np.argsort(-slot_costs, axis=2, kind="stable"), axis=2)
    first = int(np.argmax(slot_costs.reshape(6, -1).max(axis=1)))
    expected[[0, first]] = expected[[first, 0]]
    assert order_within_bundles(slots, costs, "largest_first").tolist() == expected.tolist()


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_default_loss_tokens_are_length_minus_one(mode):
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 40, 50)
    members = rng.permutation(50)
    sizes = np.array([7, 0, 13, 30])
    config = PlanConfig(mode=mode, max_tokens=64)
    default = microbatch_figures(lengths, None, members, sizes, config)
    explicit = microbatch_figures(lengths, np.maximum(lengths - 1, 0), members, sizes, config)
    assert default.keys() == explicit.keys()
    for key in default:
        assert default[key].tolist() == explicit[key].tolist(), key
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    expected = [int(lengths[members[a:b]].sum()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert default["tokens"].tolist() == expected
