"""Hand-computed values of the packing metrics on packed, padded and empty dummy batches (single process)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.metrics import PackingEfficiency, PaddingRatio, RankImbalance, TokensPerSecond
from lit_seqpack.metrics.counts import BatchCounts, batch_counts
from lit_seqpack.metrics.functional import bin_balance_from_moments, packing_summary, rank_imbalance_per_step
from lit_seqpack.metrics.packing import imbalance_per_step
from lit_seqpack.metrics.tracker import PackingTracker, RunTotals
from lit_seqpack.planning import stats


def scalars(real: int, padding: int, max_tokens: int | None = 16, *, empty: bool = False) -> dict:
    """The contract's scalars of one microbatch (the tensors do not matter to the metrics)."""
    return {
        "input_ids": torch.zeros(1, real + padding, dtype=torch.long),
        "num_documents": 0 if empty else 1,
        "num_real_tokens": real,
        "num_padding_tokens": padding,
        "num_loss_tokens": max(real - 1, 0),
        "max_tokens": max_tokens,
        "is_empty": empty,
    }


# packed rows of a 16-token budget: fills 14, 10, an empty dummy of 8 padding tokens, 16
PACKED = [scalars(14, 2), scalars(10, 6), scalars(0, 8, empty=True), scalars(16, 0)]


def padded_batch(lengths: list[int], width: int) -> dict:
    """A right-padded [B, L] batch with its attention mask and the contract's scalars."""
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    real = sum(lengths)
    return {"attention_mask": mask, **scalars(real, len(lengths) * width - real, None)}


def test_batch_counts_reads_scalars_and_falls_back_to_the_attention_mask():
    batch = padded_batch([8, 5, 3], 8)
    assert batch_counts(batch) == BatchCounts(real_tokens=16, padding_tokens=8, max_tokens=None)
    no_scalars = {"attention_mask": batch["attention_mask"], "input_ids": batch["input_ids"]}
    assert batch_counts(no_scalars) == BatchCounts(real_tokens=16, padding_tokens=8)
    collated = {"num_real_tokens": torch.tensor(5), "num_padding_tokens": torch.tensor(3), "max_tokens": 8}
    assert batch_counts(collated) == BatchCounts(real_tokens=5, padding_tokens=3, max_tokens=8)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.zeros(1, 4)}, "num_real_tokens"),
        ({"num_real_tokens": 3.0, "num_padding_tokens": 1}, "num_real_tokens"),
        ({"num_real_tokens": True, "num_padding_tokens": 1}, "num_real_tokens"),
        ({"num_real_tokens": -1, "num_padding_tokens": 1}, "real_tokens"),
        ({"num_real_tokens": 3, "num_padding_tokens": 1, "max_tokens": 0}, "max_tokens"),
        ([1, 2], "batch dict"),
    ],
)
def test_batch_counts_rejects_bad_batches(batch, match):
    with pytest.raises(ValueError, match=match):
        batch_counts(batch)


def test_batch_counts_sum_keeps_a_shared_budget_only():
    a, b = BatchCounts(real_tokens=3, padding_tokens=1, max_tokens=8), BatchCounts(real_tokens=5, padding_tokens=0)
    assert a + a == BatchCounts(real_tokens=6, padding_tokens=2, max_tokens=8)
    assert (a + b).max_tokens is None and (a + b).computed_tokens == 9


def test_padding_ratio_packed_with_empty_dummy():
    metric = PaddingRatio()
    for batch in PACKED:
        metric.update(batch)
    # padding 2 + 6 + 8 + 0 = 16 of 16 + 16 + 8 + 16 = 56 computed tokens
    assert metric.compute().item() == pytest.approx(16 / 56)
    assert metric.higher_is_better is False and metric.full_state_update is False


def test_padding_ratio_padded_batches_compare_with_packed():
    metric = PaddingRatio()
    metric.update(padded_batch([8, 5, 3], 8))  # 8 of 24 padded
    metric.update(padded_batch([2, 2], 4))  # 4 of 8 padded
    assert metric.compute().item() == pytest.approx(12 / 32)
    fallback = PaddingRatio()
    fallback.update({"attention_mask": padded_batch([8, 5, 3], 8)["attention_mask"]})
    assert fallback.compute().item() == pytest.approx(1 / 3)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")
def test_padding_ratio_is_zero_without_tokens_and_forward_returns_the_batch_value():
    metric = PaddingRatio()
    assert metric.compute().item() == 0.0
    assert metric(scalars(6, 2)).item() == pytest.approx(0.25)
    assert metric(scalars(0, 8, empty=True)).item() == pytest.approx(1.0)
    assert metric.compute().item() == pytest.approx(10 / 16)


def test_tokens_per_second_sums_tokens_and_keeps_the_latest_clock():
    real, computed = TokensPerSecond(), TokensPerSecond(tokens="computed")
    for metric in (real, computed):
        metric.update(PACKED[0], elapsed=0.5)
        metric.update(PACKED[1])
        metric.update(PACKED[2], elapsed=1.5)
        metric.update(PACKED[3])
        metric.update(elapsed=2.0)
    assert real.compute().item() == pytest.approx(40 / 2.0)
    assert computed.compute().item() == pytest.approx(56 / 2.0)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")
def test_tokens_per_second_forward_keeps_the_global_state_right():
    metric = TokensPerSecond()
    metric(PACKED[0], elapsed=1.0)
    metric(PACKED[1], elapsed=2.0)
    assert metric.compute().item() == pytest.approx(24 / 2.0)
    assert TokensPerSecond().compute().item() == 0.0


@pytest.mark.parametrize("elapsed", [-1.0, math.nan, math.inf, "1"])
def test_tokens_per_second_rejects_bad_elapsed(elapsed):
    with pytest.raises(ValueError, match="elapsed"):
        TokensPerSecond().update(PACKED[0], elapsed=elapsed)


def test_tokens_per_second_rejects_an_empty_update_and_a_bad_kind():
    with pytest.raises(ValueError, match="needs a batch"):
        TokensPerSecond().update()
    with pytest.raises(ValueError, match="tokens=.padding. must be one of"):
        TokensPerSecond(tokens="padding")


def test_packing_efficiency_packed_with_empty_dummy():
    metric = PackingEfficiency()
    for batch in PACKED:
        metric.update(batch)
    values = {key: value.item() for key, value in metric.compute().items()}
    # fills 14, 10, 0, 16 of capacity 16: 40 / 64; ceil(40 / 16) = 3 bins would do, 4 were trained
    assert values["bin_utilization"] == pytest.approx(40 / 64)
    assert values["waste_ratio"] == pytest.approx(24 / 64)
    assert values["packing_efficiency"] == pytest.approx(3 / 4)
    # population stdev of the fills: sqrt(((14-10)^2 + 0 + 10^2 + 6^2) / 4) = sqrt(38); mean 10
    assert values["bin_balance"] == pytest.approx(1 - math.sqrt(38) / 10, rel=1e-6)
    without_dummy = PackingEfficiency()
    for batch in (PACKED[0], PACKED[1], PACKED[3]):
        without_dummy.update(batch)
    assert without_dummy.compute()["packing_efficiency"].item() == pytest.approx(1.0)


def test_packing_efficiency_padded_batches_use_their_computed_tokens_as_capacity():
    metric = PackingEfficiency()
    metric.update(padded_batch([8, 5, 3], 8))
    metric.update(padded_batch([2, 2], 4))
    values = {key: value.item() for key, value in metric.compute().items()}
    assert values["bin_utilization"] == pytest.approx(20 / 32)  # 1 - padding ratio
    assert values["packing_efficiency"] == pytest.approx(1 / 2)  # ceil(20 / 24) = 1 bin of the largest capacity
    assert values["bin_balance"] == pytest.approx(1 - 6 / 10, rel=1e-6)  # fills 16 and 4: pstdev 6, mean 10


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")
def test_packing_efficiency_without_bins_or_with_one_bin():
    assert {k: v.item() for k, v in PackingEfficiency().compute().items()} == {
        "packing_efficiency": 1.0,
        "bin_utilization": 1.0,
        "waste_ratio": 0.0,
        "bin_balance": 1.0,
    }
    metric = PackingEfficiency()
    metric.update(scalars(0, 8, empty=True))
    values = {key: value.item() for key, value in metric.compute().items()}
    assert values == {"packing_efficiency": 0.0, "bin_utilization": 0.0, "waste_ratio": 1.0, "bin_balance": 1.0}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=70_000), min_size=1, max_size=30))
def test_balance_from_moments_equals_the_planner_formula(fills):
    array = np.asarray(fills, dtype=np.int64)
    moments = bin_balance_from_moments(len(fills), int(array.sum()), int((array * array).sum()))
    assert moments == pytest.approx(stats.bin_balance(array), abs=1e-9)


def test_packing_summary_matches_the_planner_stats_of_the_same_bins():
    lengths = [3000, 1000, 2000, 500, 4096]
    bins = [[0, 1], [2, 3], [4]]
    expected = stats.packing_stats(lengths, bins, 4096)
    fills = [4000, 2500, 4096]
    summary = packing_summary(
        num_bins=3,
        fill_sum=sum(fills),
        fill_sq_sum=sum(f * f for f in fills),
        capacity_sum=3 * 4096,
        max_capacity=4096,
    )
    assert summary["bin_utilization"] == pytest.approx(expected.bin_utilization)
    assert summary["waste_ratio"] == pytest.approx(expected.waste_ratio)
    assert summary["bin_balance"] == pytest.approx(expected.bin_balance)
    assert summary["packing_efficiency"] == pytest.approx(expected.packing_efficiency)


def test_rank_imbalance_per_step_formula():
    assert rank_imbalance_per_step([[100, 300, 0], [300, 300, 0]]) == [1.5, 1.0, 1.0]
    assert rank_imbalance_per_step([[10], [20], [30], [40]]) == [pytest.approx(40 / 25)]
    assert rank_imbalance_per_step([]) == []
    with pytest.raises(ValueError, match="same number of optimizer steps"):
        rank_imbalance_per_step([[1, 2], [3]])


def test_rank_imbalance_lines_up_the_rows_of_each_rank():
    # rows as gathered from two ranks: rank 1's rows first, to show that the order of ranks does not matter
    tokens = torch.tensor([300.0, 300.0, 900.0, 100.0, 300.0, 100.0])
    ranks = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    # steps: (100, 300) -> 1.5, (300, 300) -> 1.0, (100, 900) -> 1.8
    assert imbalance_per_step(tokens, ranks) == pytest.approx([1.5, 1.0, 1.8])
    with pytest.raises(RuntimeError, match="lock-step"):
        imbalance_per_step(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")
def test_rank_imbalance_single_process_steps_are_balanced():
    metric = RankImbalance(tokens="computed")
    metric.update([PACKED[0], PACKED[1]])
    metric.update(PACKED[2])
    values = {key: value.item() for key, value in metric.compute().items()}
    assert values == {"rank_imbalance": 1.0, "rank_imbalance_max": 1.0}
    assert [t.item() for t in metric.step_tokens] == [32.0, 8.0]
    assert RankImbalance().compute()["rank_imbalance"].item() == 1.0


def test_tracker_windows_fold_into_exact_run_totals():
    tracker = PackingTracker()
    tracker.update(PACKED[0], step_end=False)
    tracker.update(PACKED[1])
    first = tracker.flush(elapsed=2.0)
    assert first["tokens_per_sec"] == pytest.approx(24 / 2.0)
    assert first["padding_ratio"] == pytest.approx(8 / 32)
    assert tracker.totals.steps == 1
    tracker.update(PACKED[2])
    tracker.update(PACKED[3])
    second = tracker.flush(elapsed=6.0)
    assert second["tokens_per_sec"] == pytest.approx(16 / 6.0)
    assert second["computed_tokens_per_sec"] == pytest.approx(24 / 6.0)
    assert second["real_tokens"] == 40.0 and second["padding_tokens"] == 16.0  # cumulative
    run = tracker.totals.values()
    assert run["tokens_per_sec"] == pytest.approx(40 / 8.0)
    assert run["padding_ratio"] == pytest.approx(16 / 56)
    assert run["packing_efficiency"] == pytest.approx(3 / 4)
    assert run["bin_balance"] == pytest.approx(1 - math.sqrt(38) / 10, rel=1e-6)
    assert tracker.totals.steps == 3 and run["rank_imbalance"] == 1.0
    assert all(metric.update_count == 0 for metric in tracker.metrics)


def test_run_totals_round_trip_and_reject_unknown_keys():
    totals = RunTotals(real_tokens=5, padding_tokens=3, elapsed=1.5, num_bins=2, max_capacity=8)
    assert RunTotals.from_state_dict(totals.state_dict()) == totals
    with pytest.raises(ValueError, match="unknown RunTotals keys"):
        RunTotals.from_state_dict({"real_tokens": 1, "bogus": 2})


@pytest.mark.gpu
def test_metrics_on_cuda_match_cpu():
    device = torch.device("cuda")
    tracker = PackingTracker().to(device)
    for batch in PACKED:
        tracker.update(batch)
    assert tracker.padding.padding_tokens.device.type == "cuda"
    values = tracker.flush(elapsed=2.0)
    assert values["padding_ratio"] == pytest.approx(16 / 56)
    assert values["packing_efficiency"] == pytest.approx(3 / 4)
    assert values["tokens_per_sec"] == pytest.approx(20.0)
