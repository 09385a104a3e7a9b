from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning.algorithms import PACKING_ALGORITHMS, get_packer
from lit_seqpack.planning.stats import (
    PackingStats,
    bin_balance,
    bin_fills,
    bin_utilization,
    packing_efficiency,
    packing_stats,
    theoretical_min_bins,
    waste_ratio,
)


def test_formulas_on_hand_checked_numbers():
    assert theoretical_min_bins(0, 4096) == 0
    assert theoretical_min_bins(4096, 4096) == 1
    assert theoretical_min_bins(4097, 4096) == 2
    assert bin_utilization(6144, 2, 4096) == 0.75
    assert waste_ratio(6144, 2, 4096) == 0.25
    assert packing_efficiency(3, 4) == 0.75
    assert bin_balance([3000, 1000]) == 0.5
    assert bin_balance(np.array([7, 7, 7])) == 1.0
    assert bin_balance([100, 0, 0, 0]) == pytest.approx(1 - math.sqrt(3))


def test_edge_cases_do_not_divide_by_zero():
    assert bin_utilization(0, 0, 4096) == 1.0
    assert waste_ratio(0, 0, 4096) == 0.0
    assert packing_efficiency(0, 0) == 1.0
    assert bin_balance([]) == 1.0
    assert bin_balance([0, 0]) == 1.0


def test_formulas_accept_numpy_scalars():
    total, bins, cap = np.int64(6144), np.int64(2), np.int32(4096)
    assert bin_utilization(total, bins, cap) == 0.75
    assert theoretical_min_bins(total, cap) == 2
    assert isinstance(packing_efficiency(np.int64(3), np.int64(4)), float)


def test_packing_stats_by_hand():
    stats = packing_stats([3000, 1000, 2000, 500], [[0, 1], [2, 3]], 4096)
    assert stats == PackingStats(
        num_bins=2,
        num_sequences=4,
        total_tokens=6500,
        capacity=4096,
        theoretical_min_bins=2,
        bin_utilization=6500 / 8192,
        waste_ratio=1 - 6500 / 8192,
        bin_balance=1 - 750 / 3250,
        packing_efficiency=1.0,
        padding_tokens=8192 - 6500,
        min_fill=2500,
        max_fill=4000,
        mean_fill=3250.0,
    )
    assert stats.as_dict()["num_bins"] == 2


def test_packing_stats_without_bins_and_with_empty_sequences():
    empty = packing_stats([], [], 16)
    assert (empty.num_bins, empty.bin_utilization, empty.waste_ratio) == (0, 1.0, 0.0)
    assert (empty.packing_efficiency, empty.bin_balance, empty.max_fill, empty.mean_fill) == (1.0, 1.0, 0, 0.0)
    zeros = packing_stats([0, 0], [[0, 1]], 16)
    assert (zeros.theoretical_min_bins, zeros.packing_efficiency, zeros.bin_utilization) == (0, 0.0, 0.0)


def test_packing_stats_of_a_subset_counts_only_its_bins():
    stats = packing_stats([10, 20, 30], [[2]], 32)
    assert (stats.total_tokens, stats.num_sequences, stats.theoretical_min_bins) == (30, 1, 1)


@pytest.mark.parametrize(
    ("bins", "capacity", "message"),
    [
        ([[0, 3]], 64, r"bins contain index 3, outside \[0, 3\)"),
        ([[0, -1]], 64, r"bins contain index -1, outside \[0, 3\)"),
        ([[0, 1], [1]], 64, "bins contain index 1 more than once"),
        ([[1, 2]], 32, "bin 0 holds 50 tokens, above the capacity 32"),
        ([[0]], 0, "capacity must be an int >= 1, got 0"),
    ],
)
def test_packing_stats_rejects_bad_bins(bins, capacity, message):
    with pytest.raises(ValueError, match=message):
        packing_stats([10, 20, 30], bins, capacity)


def test_bin_fills():
    assert bin_fills([5, 6, 7], [[2, 0], [1]]).tolist() == [12, 6]
    assert bin_fills([5], []).tolist() == []


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(1, 50),
    lengths=st.lists(st.integers(0, 50), max_size=40),
)
def test_stats_invariants_on_real_packings(algorithm, capacity, lengths):
    lengths = [min(length, capacity) for length in lengths]
    bins = get_packer(algorithm, capacity).pack(lengths)
    stats = packing_stats(lengths, bins, capacity)
    assert stats.num_bins == len(bins)
    assert stats.total_tokens == sum(lengths)
    assert stats.theoretical_min_bins <= stats.num_bins
    assert 0.0 <= stats.bin_utilization <= 1.0
    assert stats.waste_ratio == pytest.approx(1.0 - stats.bin_utilization)
    assert stats.bin_balance <= 1.0
    assert stats.padding_tokens == stats.num_bins * capacity - stats.total_tokens
    if sum(lengths) > 0:
        assert 0.0 < stats.packing_efficiency <= 1.0
