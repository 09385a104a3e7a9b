from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning.dynamic import dynamic_group_sizes, dynamic_groups, fixed_group_sizes, round_up


def test_round_up():
    assert round_up(np.array([0, 1, 4, 5, 8]), 4).tolist() == [0, 4, 4, 8, 8]
    assert round_up(7, 1) == 7


def test_groups_fill_the_budget_greedily():
    # 2048 // 900 = 2 rows, 2048 // 690 = 2 rows, 2048 // 390 = 5 rows (only 3 left)
    assert dynamic_groups([120, 900, 390, 700, 400, 690, 380], 2048) == [[1, 3], [5, 4], [2, 6, 0]]


def test_rounding_shrinks_groups():
    # 2400 // 400 = 6 rows, but padded to 512 only 2400 // 512 = 4 rows fit
    assert dynamic_group_sizes(np.array([400] * 6), 2400).tolist() == [6]
    assert dynamic_group_sizes(np.array([400] * 6), 2400, sequence_length_round=256).tolist() == [4, 2]


def test_split_prefers_largest_groups_and_keeps_order():
    sizes = dynamic_group_sizes(np.array([1000, 900] + [100] * 10), 2048, group_count_multiple=4)
    assert sizes.tolist() == [2, 4, 3, 3]  # [2, 10] -> the 10-row group split into 4 + 3 + 3


def test_fillers_only_when_nothing_can_be_split():
    sizes = dynamic_group_sizes(np.array([5, 4, 3]), 100, group_count_multiple=8)
    assert sizes.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_rejects_unsorted_and_overlong():
    with pytest.raises(ValueError, match="decreasing"):
        dynamic_group_sizes(np.array([1, 5]), 10)
    with pytest.raises(ValueError, match="max_tokens=10"):
        dynamic_group_sizes(np.array([11, 5]), 10)
    with pytest.raises(ValueError, match="one-dimensional"):
        dynamic_groups([[1, 2]], 10)


def test_fixed_group_sizes():
    assert fixed_group_sizes(10, 4).tolist() == [4, 4, 2]
    assert fixed_group_sizes(8, 4, group_count_multiple=3).tolist() == [4, 4, 0]
    assert fixed_group_sizes(0, 4, group_count_multiple=3).tolist() == []


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 256), min_size=0, max_size=80),
    max_tokens=st.sampled_from([256, 512, 1000]),
    rounding=st.sampled_from([1, 8, 64]),
    multiple=st.integers(1, 12),
)
def test_dynamic_group_properties(lengths, max_tokens, rounding, multiple):
    groups = dynamic_groups(lengths, max_tokens, sequence_length_round=rounding, group_count_multiple=multiple)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    assert len(groups) % multiple == 0
    arr = np.asarray(lengths, dtype=np.int64)
    for g in groups:
        if g:
            assert len(g) * round_up(int(arr[g].max()), rounding) <= max_tokens  # the budget holds
    ordered = [int(arr[i]) for i in flat]
    assert ordered == sorted(ordered, reverse=True)  # longest first, groups are runs of the sorted order
    empties = sum(1 for g in groups if not g)
    if empties:
        assert all(len(g) <= 1 for g in groups)  # fillers only when every group is a single row


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60), max_tokens=st.sampled_from([300, 700]))
def test_greedy_groups_cannot_take_the_next_row(lengths, max_tokens):
    arr = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    sizes = dynamic_group_sizes(arr, max_tokens)
    starts = np.concatenate(([0], np.cumsum(sizes)))[:-1]
    for start, size in zip(starts[:-1], sizes[:-1], strict=True):
        assert (size + 1) * arr[start] > max_tokens
