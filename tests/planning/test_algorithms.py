from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning import _kernels, algorithms
from lit_seqpack.planning.algorithms import PACKING_ALGORITHMS, get_packer

_spec = importlib.util.spec_from_file_location(
    "_reference_packers", Path(__file__).parents[2] / "benchmarks" / "_reference_packers.py"
)
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def packing_inputs(draw: st.DrawFn) -> tuple[list[int], int]:
    capacity = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(0, capacity), max_size=40))
    return lengths, capacity


def check_valid(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


def lognormal(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(512), 1.0, n)), 16, 4096).astype(np.int64)


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@SETTINGS
@given(data=packing_inputs(), seed=st.integers(0, 3))
def test_every_index_once_within_capacity_deterministic(algorithm, data, seed):
    lengths, capacity = data
    bins = get_packer(algorithm, capacity, seed=seed).pack(lengths)
    check_valid(bins, lengths, capacity)
    assert get_packer(algorithm, capacity, seed=seed).pack(np.array(lengths, dtype=np.int32)) == bins


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@SETTINGS
@given(data=packing_inputs(), seed=st.integers(0, 3))
def test_same_bins_as_textbook_reference(algorithm, data, seed):
    lengths, capacity = data
    bins = get_packer(algorithm, capacity, seed=seed).pack(lengths)
    expected = reference.REFERENCE_PACKERS[algorithm](lengths, capacity, seed)
    assert [sorted(b) for b in bins] == [sorted(b) for b in expected]


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@SETTINGS
@given(data=packing_inputs(), min_bins=st.integers(0, 45), multiple=st.integers(1, 5))
def test_bin_count_options(algorithm, data, min_bins, multiple):
    lengths, capacity = data
    plain = get_packer(algorithm, capacity).pack(lengths)
    packer = get_packer(algorithm, capacity, min_bin_count=min_bins, bin_count_multiple=multiple)
    expected = -(-max(len(plain), min_bins) // multiple) * multiple
    if expected > len(lengths):
        with pytest.raises(ValueError, match=f"Cannot create {expected} bins with only {len(lengths)} sequences"):
            packer.pack(lengths)
        return
    bins = packer.pack(lengths)
    assert len(bins) == expected
    check_valid(bins, lengths, capacity)
    fill = [sum(lengths[i] for i in b) for b in bins]
    assert max(fill, default=0) <= max((sum(lengths[i] for i in b) for b in plain), default=0)
    if expected == len(plain):
        assert bins == plain


def test_splitting_halves_the_fullest_bin():
    lengths = [4, 4, 4, 4, 3, 1]
    plain = get_packer("concatenative", 16).pack(lengths)
    assert plain == [[0, 1, 2, 3], [4, 5]]
    assert get_packer("concatenative", 16, min_bin_count=3).pack(lengths) == [[0, 2], [4, 5], [1, 3]]
    assert get_packer("concatenative", 16, min_bin_count=4).pack(lengths) == [[0], [4, 5], [1, 3], [2]]
    assert get_packer("concatenative", 16, bin_count_multiple=3).pack(lengths) == [[0, 2], [4, 5], [1, 3]]


def test_single_item_bins_are_never_split():
    lengths = [10, 2, 2, 2]
    assert get_packer("first_fit_decreasing", 10).pack(lengths) == [[0], [1, 2, 3]]
    assert get_packer("first_fit_decreasing", 10, min_bin_count=3).pack(lengths) == [[0], [1, 3], [2]]


def test_concatenative_keeps_input_order():
    assert get_packer("concatenative", 10).pack([6, 5, 4, 3, 2, 9]) == [[0], [1, 2], [3, 4], [5]]


def test_first_fit_and_best_fit_decreasing_by_hand():
    lengths = [5, 7, 4, 1]  # sorted: 7 (1), 5 (0), 4 (2), 1 (3); rooms 3 and 1 before the 1 arrives
    assert get_packer("first_fit_decreasing", 10).pack(lengths) == [[1, 3], [0, 2]]
    assert get_packer("best_fit_decreasing", 10).pack(lengths) == [[1], [0, 2, 3]]
    # equal lengths keep index order; best fit breaks a tie in room towards the bin that changed last
    assert get_packer("first_fit_decreasing", 10).pack([9, 1, 9]) == [[0, 1], [2]]
    assert get_packer("best_fit_decreasing", 10).pack([9, 1, 9]) == [[0], [2, 1]]


def test_modified_first_fit_decreasing_pairs_of_smalls():
    # C = 60: large > 30, medium in (20, 30], small in (10, 20], tiny <= 10.
    lengths = [12, 31, 14, 11, 15]
    # FFD puts 15 and 14 with the 31; MFFD adds the smallest small (11) and the largest that still fits (15).
    assert get_packer("first_fit_decreasing", 60).pack(lengths) == [[1, 4, 2], [0, 3]]
    assert get_packer("modified_first_fit_decreasing", 60).pack(lengths) == [[1, 4, 3], [2, 0]]


def test_modified_first_fit_decreasing_mediums_then_greedy_fill():
    # 40 and 35 open bins (rooms 20, 25); 25 is the only medium that fits (into 35's bin), the greedy
    # fill gives the small 12 to 40's bin, and the medium 22 is left over for first fit in a new bin.
    assert get_packer("modified_first_fit_decreasing", 60).pack([40, 35, 25, 22, 12]) == [[0, 4], [1, 2], [3]]
    # 35 takes the medium 25; the pair of smalls (11 and then 13) goes to the bin without a medium
    assert get_packer("modified_first_fit_decreasing", 60).pack([31, 35, 25, 13, 11]) == [[1, 2], [0, 3, 4]]


def test_modified_first_fit_decreasing_pairs_go_backward():
    # 32 and 31 open bins (rooms 28, 29); backward, 31's bin gets 11 + 14, then 32's bin gets 12 + 13
    lengths = [31, 32, 11, 12, 13, 14]
    assert get_packer("modified_first_fit_decreasing", 60).pack(lengths) == [[1, 4, 3], [0, 5, 2]]
    assert get_packer("first_fit_decreasing", 60).pack(lengths) == [[1, 5, 4], [0, 3, 2]]


def test_first_fit_shuffle_seed_and_global_state():
    lengths = lognormal(300, seed=1)
    random.seed(123)
    np.random.seed(123)
    before = (random.getstate(), np.random.get_state()[1].copy())
    first = get_packer("first_fit_shuffle", 4096, seed=0).pack(lengths)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    random.seed(7)
    np.random.seed(7)
    assert get_packer("first_fit_shuffle", 4096, seed=0).pack(lengths) == first
    assert get_packer("first_fit_shuffle", 4096, seed=1).pack(lengths) != first


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_zero_length_sequences_are_placed(algorithm):
    assert [sorted(b) for b in get_packer(algorithm, 5).pack([0, 0, 0])] == [[0, 1, 2]]
    bins = get_packer(algorithm, 5).pack([5, 0, 5, 0, 3])
    check_valid(bins, [5, 0, 5, 0, 3], 5)
    assert sorted(get_packer(algorithm, 5, min_bin_count=3).pack([0, 0, 0])) == [[0], [1], [2]]


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_empty_input(algorithm):
    assert get_packer(algorithm, 8).pack([]) == []
    assert get_packer(algorithm, 8, min_bin_count=0, bin_count_multiple=4).pack(np.array([], np.int64)) == []
    with pytest.raises(ValueError, match="Cannot create 1 bins with only 0 sequences"):
        get_packer(algorithm, 8, min_bin_count=1).pack([])


def test_algorithm_names_are_case_insensitive_and_validated():
    assert get_packer("  Best_Fit_Decreasing", 4).algorithm == "best_fit_decreasing"
    with pytest.raises(
        ValueError, match=r"one of \('concatenative', 'first_fit_decreasing', .*'best_fit_decreasing'\), got 'ffd'"
    ):
        get_packer("ffd", 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0}, "capacity must be an int >= 1, got 0"),
        ({"capacity": -3}, "capacity must be an int >= 1, got -3"),
        ({"capacity": 4.0}, "capacity must be an int >= 1, got 4.0"),
        ({"capacity": True}, "capacity must be an int >= 1, got True"),
        ({"min_bin_count": -1}, "min_bin_count must be an int >= 0 or None, got -1"),
        ({"bin_count_multiple": 0}, "bin_count_multiple must be an int >= 1 or None, got 0"),
        ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_invalid_arguments_fail_when_built(kwargs, message):
    args = {"capacity": 8} | kwargs
    with pytest.raises(ValueError, match=message):
        get_packer("first_fit_decreasing", args.pop("capacity"), **args)


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 9, 2], r"lengths\[1\] = 9 is above the capacity \(capacity=8\)"),
        ([3, 2, -1], r"lengths\[2\] = -1 is negative \(capacity=8\)"),
        ([3.0, 2.5], r"lengths\[1\] = 2.5 is not an integer \(capacity=8\)"),
        ([1.0, float("nan")], r"lengths\[1\] = nan is not an integer \(capacity=8\)"),
        (["3", 2], r"lengths\[0\] = '3' is not an integer \(capacity=8\)"),
        ([[1, 2]], r"lengths must be one-dimensional, got shape \(1, 2\)"),
    ],
)
def test_invalid_lengths_name_index_length_and_capacity(algorithm, lengths, message):
    with pytest.raises(ValueError, match=message):
        get_packer(algorithm, 8).pack(lengths)


def test_integral_floats_are_accepted():
    assert get_packer("first_fit_decreasing", 8).pack([3.0, 5.0, 8.0]) == [[2], [1, 0]]


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@pytest.mark.parametrize("capacity", [4096, 1000])
def test_pure_python_fallback_gives_identical_bins(algorithm, capacity, monkeypatch):
    lengths = np.minimum(lognormal(3000, seed=2), capacity)
    lengths[::97] = 0
    packer = get_packer(algorithm, capacity, seed=5, min_bin_count=700)
    assert _kernels.numba_enabled() == _kernels.NUMBA_AVAILABLE
    compiled = packer.pack(lengths)
    monkeypatch.setenv(_kernels.DISABLE_ENV_VAR, "1")
    assert not _kernels.numba_enabled()
    assert _kernels.get_kernel("first_fit") is _kernels.first_fit
    assert packer.pack(lengths) == compiled


def test_runs_when_numba_cannot_be_imported():
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "from lit_seqpack.planning import _kernels, algorithms\n"
        "assert not _kernels.NUMBA_AVAILABLE and not _kernels.numba_enabled()\n"
        "print([algorithms.get_packer(a, 10).pack([6, 5, 4, 3, 2, 0]) for a in algorithms.PACKING_ALGORITHMS])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = [get_packer(a, 10).pack([6, 5, 4, 3, 2, 0]) for a in PACKING_ALGORITHMS]
    assert done.stdout.strip() == str(expected)


@pytest.mark.parametrize("numba_off", [False, True])
def test_best_fit_kernels_agree(numba_off, monkeypatch):
    if numba_off:
        monkeypatch.setenv(_kernels.DISABLE_ENV_VAR, "1")
    rng = np.random.default_rng(3)
    for capacity in (1, 7, 100, 4096):
        sizes = np.sort(rng.integers(0, capacity + 1, 1500))[::-1].copy()
        dense = _kernels.get_kernel("best_fit_dense")(sizes, capacity)
        assert np.array_equal(dense, _kernels.get_kernel("best_fit_sorted")(sizes, capacity))


def test_huge_capacity_uses_the_sorted_best_fit():
    lengths = (lognormal(2000, seed=4) * 3000).tolist()
    capacity = 1 << 24
    bins = get_packer("best_fit_decreasing", capacity).pack(lengths)
    check_valid(bins, lengths, capacity)
    expected = reference.best_fit_decreasing(lengths, capacity)
    assert [sorted(b) for b in bins] == [sorted(b) for b in expected]


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "best_fit_decreasing", "modified_first_fit_decreasing"])
def test_decreasing_packers_are_near_the_lower_bound(algorithm):
    lengths = lognormal(20_000, seed=0)
    bins = get_packer(algorithm, 4096).pack(lengths)
    check_valid(bins, lengths.tolist(), 4096)
    assert len(bins) <= 1.001 * -(-int(lengths.sum()) // 4096) + 1


@pytest.mark.parametrize("numba_off", [False, True])
@SETTINGS
@given(data=packing_inputs())
def test_first_fit_runs_places_like_first_fit_item_by_item(numba_off, data):
    lengths, capacity = data
    with pytest.MonkeyPatch.context() as patch:
        if numba_off:
            patch.setenv(_kernels.DISABLE_ENV_VAR, "1")
        sizes = np.sort(np.asarray(lengths, dtype=np.int64))[::-1].copy()
        expected = _kernels.get_kernel("first_fit")(sizes, capacity, np.zeros(0, np.int64))
        values, counts = np.unique(sizes, return_counts=True)
        runs = values[::-1].astype(np.int64), counts[::-1].astype(np.int64)
        bins = np.empty(sizes.size, np.int64)
        n_bins, fills = _kernels.get_kernel("first_fit_runs")(*runs, capacity, bins)
        counted, _ = _kernels.get_kernel("first_fit_runs")(*runs, capacity, np.zeros(0, np.int64))
    assert bins.tolist() == expected.tolist()
    assert n_bins == counted == (int(expected.max()) + 1 if sizes.size else 0)
    assert fills.tolist() == np.bincount(expected, weights=sizes, minlength=n_bins).astype(int).tolist()


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
@pytest.mark.parametrize("dtype", [np.int64, np.uint16, np.uint32])
@SETTINGS
@given(data=packing_inputs(), seed=st.integers(0, 3))
def test_count_bins_is_the_bin_count_of_pack(algorithm, dtype, data, seed):
    lengths, capacity = data
    packer = get_packer(algorithm, capacity, seed=seed)
    assert packer.count_bins(np.asarray(lengths, dtype=dtype)) == len(packer.pack(lengths))


@SETTINGS
@given(sizes=st.lists(st.integers(0, 70_000), max_size=50))
def test_decreasing_order_is_the_stable_sort(sizes):
    array = np.asarray(sizes, dtype=np.int64)
    expected = np.argsort(-array, kind="stable").tolist()
    assert algorithms._decreasing(array).tolist() == expected  # counting sort or argsort (large sizes, few items)
    assert algorithms._decreasing(array % 300).tolist() == np.argsort(-(array % 300), kind="stable").tolist()


def test_first_fit_decreasing_counts_a_large_window_from_its_histogram():
    lengths = lognormal(200_000, seed=7).astype(np.uint16)
    packer = get_packer("first_fit_decreasing", 8192)
    flat, ends = packer.pack_flat(lengths)
    assert packer.count_bins(lengths) == ends.size
    order = np.argsort(-lengths.astype(np.int64), kind="stable")
    item_by_item = _kernels.get_kernel("first_fit")(lengths[order].astype(np.int64), 8192, np.zeros(0, np.int64))
    assert ends.size == int(item_by_item.max()) + 1
