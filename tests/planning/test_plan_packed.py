"""``plan_packed``: a window packed elsewhere (the streaming buffer) planned as packed, like ``build_plan``."""

from __future__ import annotations

import numpy as np
import pytest

from lit_seqpack.planning.algorithms import get_packer
from lit_seqpack.planning.plan import PlanConfig, build_plan, plan_packed


def _config(**overrides) -> PlanConfig:
    return PlanConfig(**{"mode": "packing", "max_tokens": 64, "algorithm": "best_fit_decreasing", "world_size": 2,
                         "accumulate_grad_batches": 2, "shuffle": False, **overrides})  # fmt: skip


def _bins(plan) -> list[list[int]]:  # noqa: ANN001 - a Plan
    return sorted(sorted(mb) for r in range(plan.config.world_size) for mb in plan.rank_microbatches(r) if mb)


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_bins_given_are_the_plans_and_its_figures_are_build_plans(shuffle: bool) -> None:
    lengths = np.random.default_rng(0).integers(1, 64, 300)
    config = _config(shuffle=shuffle)
    bins = get_packer("best_fit_decreasing", 64, bin_count_multiple=config.slots_per_step).pack_flat(lengths)
    loss = np.maximum(lengths - 2, 0)
    packed = plan_packed(lengths, bins, config, epoch=3, loss_tokens=loss)
    offline = build_plan(lengths, config, epoch=3, loss_tokens=loss)  # the same packer: the same bins
    flat, ends = bins
    assert _bins(packed) == sorted(sorted(flat[a:b].tolist()) for a, b in zip([0, *ends[:-1]], ends, strict=True))
    if not shuffle:  # a shuffled plan packs the samples in its own order: equal lengths may trade places
        assert _bins(packed) == _bins(offline)
    assert packed.step_loss_tokens.sum() == loss.sum()
    assert packed.stats.utilization == offline.stats.utilization
    assert packed.microbatches_per_rank == offline.microbatches_per_rank


def test_bins_short_of_whole_steps_are_split_fullest_first_or_padded_with_fillers() -> None:
    config = _config()  # 4 slots a step
    lengths = np.array([30, 30, 20, 10, 5])
    plan = plan_packed(lengths, (np.arange(5), np.array([2, 5])), config, epoch=0)  # 2 bins: 60 and 35
    assert plan.microbatches_per_rank == 2 and plan.stats.num_empty_microbatches == 0
    assert _bins(plan) == [[0], [1], [2], [3, 4]]  # both split: 4 bins of 4 slots
    few = plan_packed(np.array([30, 20]), (np.array([0, 1]), np.array([2])), config, epoch=0)
    assert few.stats.num_empty_microbatches == 2  # 2 samples for 4 slots: one each, 2 lock-step fillers


def test_bad_bins_and_modes_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="bin 0 holds 70 tokens, more than max_tokens=64"):
        plan_packed(np.array([40, 30]), (np.array([0, 1]), np.array([2])), _config(), epoch=0)
    with pytest.raises(ValueError, match="the bins must hold each of the 3 samples once, got 2 entries"):
        plan_packed(np.array([4, 5, 6]), (np.array([0, 2]), np.array([2])), _config(), epoch=0)  # sample 1 lost
    with pytest.raises(ValueError, match="the bins must hold each of the 2 samples once"):
        plan_packed(np.array([4, 5]), (np.array([0, 0]), np.array([2])), _config(), epoch=0)
    with pytest.raises(ValueError, match="must rise by at least 1"):
        plan_packed(np.array([4, 5]), (np.array([0, 1]), np.array([0, 2])), _config(), epoch=0)
    with pytest.raises(ValueError, match=r"loss_tokens\[1\] = 9 exceeds"):
        plan_packed(np.array([4, 5]), (np.array([0, 1]), np.array([2])), _config(), epoch=0, loss_tokens=[1, 9])
    with pytest.raises(ValueError, match="mode='dynamic'"):
        plan_packed(np.array([4]), (np.array([0]), np.array([1])), _config(mode="dynamic", algorithm=None), epoch=0)
