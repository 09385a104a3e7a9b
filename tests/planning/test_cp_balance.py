from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning.balance import causal_work_per_cp_rank, cp_work_imbalance
from lit_seqpack.planning.plan import PlanConfig, build_plan


def _brute_force(real: list[int], cp: int, split: str, count: str) -> list[int]:
    """Enumerate every computed position: which rank holds it, and how many keys it attends to."""
    work = [0] * cp
    if split == "zigzag":
        for n in real:
            padded = -(-n // (2 * cp)) * (2 * cp)
            chunk = padded // (2 * cp)
            for p in range(padded):
                c = p // chunk
                rank = c if c < cp else 2 * cp - 1 - c
                work[rank] += 0 if count == "real" and p >= n else p + 1
        return work
    total = sum(real)
    piece = -(-total // cp)
    row = [(p, True) for n in real for p in range(n)] + [(p, False) for p in range(piece * cp - total)]
    for i, (p, is_real) in enumerate(row):
        work[i // piece] += 0 if count == "real" and not is_real else p + 1
    return work


@settings(max_examples=60, deadline=None)
@given(
    real=st.lists(st.integers(0, 50), min_size=0, max_size=6),
    cp=st.sampled_from([1, 2, 3, 4]),
    split=st.sampled_from(["zigzag", "contiguous"]),
    count=st.sampled_from(["computed", "real"]),
)
def test_matches_a_position_by_position_count(real, cp, split, count):
    assert causal_work_per_cp_rank(real, cp, split=split, count=count).tolist() == _brute_force(real, cp, split, count)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_computed_work_is_exactly_even_and_contiguous_is_not(cp):
    chunk = 50
    zigzag = causal_work_per_cp_rank([2 * cp * chunk], cp)
    assert zigzag.tolist() == [2 * cp * chunk**2 + chunk] * cp
    contiguous = causal_work_per_cp_rank([2 * cp * chunk], cp, split="contiguous")
    assert contiguous.sum() == zigzag.sum()  # same total work, distributed differently
    if cp > 1:
        assert contiguous[-1] / contiguous[0] > 2 * cp - 2  # the last rank pays for the whole prefix


def test_skewed_plan_is_balanced_by_zigzag_and_not_by_the_contiguous_split():
    """Lognormal lengths (median 2048, heavy tail) packed into 16k-token rows by the planner; cp = 4."""
    cp = 4
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(2048), 1.0, 2000)), 16, 16384).astype(np.int64)
    planned = -(-lengths // (2 * cp)) * (2 * cp)  # what the DataModule plans on
    plan = build_plan(planned, PlanConfig(mode="packing", max_tokens=16384, shuffle=False), epoch=0)
    bins = [[int(lengths[i]) for i in mb] for mb in plan.rank_microbatches(0)]
    zigzag = cp_work_imbalance(causal_work_per_cp_rank(bins, cp))
    real = cp_work_imbalance(causal_work_per_cp_rank(bins, cp, count="real"))
    contiguous = cp_work_imbalance(causal_work_per_cp_rank(bins, cp, split="contiguous", count="real"))
    assert zigzag.max() == 1.0  # computed work: exact
    assert real.max() <= 1.05  # real tokens only: every rank within 5% of the mean in every microbatch
    assert contiguous.mean() > 1.2 and contiguous.max() > 1.5  # the naive split: measured 1.32 and 1.99


def test_rows_and_single_row_shapes_and_imbalance():
    rows = causal_work_per_cp_rank([[6, 2], [4], []], 2)
    assert rows.shape == (3, 2) and rows[2].tolist() == [0, 0]
    assert causal_work_per_cp_rank(np.array([[8], [4]]), 2).shape == (2, 2)
    assert cp_work_imbalance(np.array([3, 1])) == 1.5
    assert cp_work_imbalance(np.zeros((1, 2))).tolist() == [1.0]
    assert causal_work_per_cp_rank([5], 2, document_multiple=8).tolist() == causal_work_per_cp_rank([8], 2).tolist()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_size": 0}, "cp_size"),
        ({"split": "ring"}, "split"),
        ({"count": "all"}, "count"),
        ({"document_multiple": 6}, "document_multiple=6 must be a multiple of 2 x cp_size = 4"),
        ({"lengths_or_bins": [3, -1]}, "must be >= 0"),
        ({"lengths_or_bins": [1.5]}, "ints"),
    ],
)
def test_bad_arguments_name_the_knob(kwargs, match):
    with pytest.raises(ValueError, match=match):
        causal_work_per_cp_rank(**({"lengths_or_bins": [8], "cp_size": 2} | kwargs))


def test_importing_it_does_not_import_torch():
    code = (
        "import sys; import lit_seqpack.planning.balance\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules; print('ok')"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"
