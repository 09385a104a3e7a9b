"""The torch-free rollout plan: groups kept together, every sample once, lock step, exact step counts, balance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lit_seqpack.planning.balance import karmarkar_karp
from lit_seqpack.planning.rollout import RolloutPlanConfig, dense_group_labels, plan_rollout

ROOT = Path(__file__).resolve().parents[2]


def zipf_lengths(n: int, seed: int = 0, top: int = 4096) -> np.ndarray:
    """Rollout-like lengths: mostly short, a few long (Zipf), capped at ``top``."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.3, n) * 16 + rng.integers(8, 64, n), top)


def all_indices(plan) -> list[int]:
    return sorted(i for step in plan.microbatches for rank in step for mb in rank for i in mb)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize("keep", [None, "microbatch", "rank"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sample_once_groups_whole_and_ranks_in_lock_step(mode, keep, world_size) -> None:
    lengths = zipf_lengths(96, seed=world_size, top=300)
    groups = np.repeat(np.random.default_rng(5).permutation(24), 4)  # 24 groups of 4, interleaved ids
    config = RolloutPlanConfig(
        max_tokens=1300, mode=mode, world_size=world_size, steps_per_rollout=3, keep_together=keep
    )
    plan = plan_rollout(lengths, config, group_ids=groups)
    assert all_indices(plan) == list(range(lengths.size))
    assert plan.num_steps == 3
    for step in plan.microbatches:
        assert len(step) == world_size
        assert {len(rank) for rank in step} == {plan.accumulate_grad_batches}
        step_groups = {int(groups[i]) for rank in step for mb in rank for i in mb}
        assert sum(len(mb) for rank in step for mb in rank) == int(np.isin(groups, list(step_groups)).sum())
        for rank in step:
            for mb in rank:
                used = lengths[mb].sum() if mode == "packing" else len(mb) * lengths[mb].max(initial=0)
                assert used <= config.max_tokens
        places = {}  # group -> the (rank, microbatch) slots holding it
        for r, rank in enumerate(step):
            for j, mb in enumerate(rank):
                for i in mb:
                    places.setdefault(int(groups[i]), set()).add((r, j))
        if keep == "microbatch":
            assert all(len(p) == 1 for p in places.values())
        if keep == "rank":
            assert all(len({r for r, _ in p}) == 1 for p in places.values())
    if keep is None:  # without keep_together the groups really are split (the checks above can fail)
        splits = [
            len({(r, j) for r, rank in enumerate(step) for j, mb in enumerate(rank) for i in mb if groups[i] == g})
            for step in plan.microbatches
            for g in {int(groups[i]) for rank in step for mb in rank for i in mb}
        ]
        assert max(splits) > 1


def test_samples_per_step_gives_the_exact_number_of_steps_whatever_the_packing() -> None:
    for seed in range(3):
        lengths = zipf_lengths(64, seed=seed, top=500)
        plan = plan_rollout(lengths, RolloutPlanConfig(max_tokens=600, world_size=2, samples_per_step=16))
        assert plan.num_steps == 4 and plan.step_documents.tolist() == [16] * 4
        assert plan.step_loss_tokens.sum() == (lengths - 1).sum()


def test_steps_per_rollout_cuts_near_equal_steps_at_group_boundaries() -> None:
    groups = np.repeat(np.arange(10), [2, 3, 2, 4, 2, 2, 3, 2, 2, 2])  # 24 samples
    plan = plan_rollout(np.full(24, 5), RolloutPlanConfig(max_tokens=64, steps_per_rollout=3), group_ids=groups)
    assert plan.step_documents.tolist() == [7, 8, 9]  # the group boundaries nearest to 8 and 16 samples
    assert plan.step_documents.sum() == 24 and plan.step_groups.sum() == 10


def test_fixed_accumulation_splits_bins_then_adds_fillers() -> None:
    plan = plan_rollout([10, 10, 10], RolloutPlanConfig(max_tokens=64, world_size=2, accumulate_grad_batches=2))
    assert plan.accumulate_grad_batches == 2
    sizes = sorted(len(mb) for rank in plan.microbatches[0] for mb in rank)
    assert sizes == [0, 1, 1, 1]  # the rank holding two samples runs them apart; the other rank gets a filler
    with pytest.raises(ValueError, match="needs 3 microbatches .* accumulate_grad_batches=1"):
        plan_rollout([40, 40, 40], RolloutPlanConfig(max_tokens=64, accumulate_grad_batches=1))


def test_group_loss_tokens_are_the_totals_of_the_whole_group() -> None:
    loss = np.array([3, 4, 5, 6])
    plan = plan_rollout(
        [6, 6, 6, 7], RolloutPlanConfig(max_tokens=8, world_size=2), loss_tokens=loss, group_ids=[1, 1, 2, 2]
    )
    assert plan.group_loss_tokens.tolist() == [7, 7, 11, 11]
    assert plan.step_groups.tolist() == [2]


@pytest.mark.parametrize("world_size", [8])
def test_sample_level_balance_reaches_1_01_on_512_samples(world_size: int) -> None:
    lengths = zipf_lengths(512, seed=11, top=2048)
    config = RolloutPlanConfig(max_tokens=4096, world_size=world_size, samples_per_step=512)
    plan = plan_rollout(lengths, config)
    assert plan.imbalance("cost")[1] <= 1.01
    assert plan.imbalance("tokens")[1] <= 1.05


def test_the_plan_is_deterministic_and_torch_free() -> None:
    lengths = zipf_lengths(100, seed=2, top=400)
    config = RolloutPlanConfig(max_tokens=512, world_size=4, steps_per_rollout=2, shuffle=True, seed=3)
    assert plan_rollout(lengths, config).microbatches == plan_rollout(lengths, config).microbatches
    other = RolloutPlanConfig(max_tokens=512, world_size=4, steps_per_rollout=2, shuffle=True, seed=4)
    assert plan_rollout(lengths, config).microbatches != plan_rollout(lengths, other).microbatches
    script = (
        "import sys; from lit_seqpack.planning.rollout import RolloutPlanConfig, plan_rollout; "
        "plan_rollout([5, 3, 4], RolloutPlanConfig(max_tokens=8, world_size=2)); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_karmarkar_karp_keeps_every_item_once() -> None:
    costs = np.random.default_rng(0).random(200)
    parts = karmarkar_karp(costs, 7)
    assert sorted(i for p in parts for i in p) == list(range(200))
    sums = [costs[p].sum() for p in parts]
    assert max(sums) / np.mean(sums) < 1.001
    assert karmarkar_karp([], 3) == [[], [], []]
    assert sorted(map(len, karmarkar_karp([1.0, 2.0], 3))) == [0, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "lengths", "groups", "message"),
    [
        ({"max_tokens": 8}, [9, 3], None, "sample 0 has 9 tokens > max_tokens=8"),
        ({"max_tokens": 8, "keep_together": "microbatch"}, [5, 5], [0, 0], "group 0 .* needs 10 tokens > max_tokens=8"),
        ({"max_tokens": 8, "samples_per_step": 3}, [2, 2, 2, 2], None, "not a multiple of samples_per_step=3"),
        ({"max_tokens": 8, "samples_per_step": 1}, [2, 2], [0, 0], "samples_per_step=1 cuts a group in two"),
        ({"max_tokens": 8, "steps_per_rollout": 3}, [2, 2], None, "steps_per_rollout=3 is more than"),
        ({"max_tokens": 8}, [], None, "the rollout has no sample"),
        ({"max_tokens": 8}, [2, 2], [0.5, 1.0], "group_ids must be 2 integers"),
    ],
)
def test_bad_rollouts_fail_with_the_setting_named(kwargs, lengths, groups, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_rollout(lengths, RolloutPlanConfig(**kwargs), group_ids=groups)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"max_tokens": 8, "mode": "padded"}, "mode=.padded. must be one of"),
        ({"max_tokens": 8, "keep_together": "step"}, "keep_together=.step. must be one of"),
        ({"max_tokens": 8, "samples_per_step": 2, "steps_per_rollout": 2}, "not both"),
        ({"max_tokens": 8, "mode": "dynamic", "algorithm": "first_fit_decreasing"}, "in mode 'packing'"),
        ({"max_tokens": 8, "cost_quadratic": -1.0}, "cost_quadratic must be a finite number"),
        ({"max_tokens": 9, "mode": "dynamic", "sequence_length_round": 4}, "multiple of sequence_length_round"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutPlanConfig(**kwargs)


def test_dense_group_labels_follow_first_appearance() -> None:
    assert dense_group_labels(None, 3).tolist() == [0, 1, 2]
    assert dense_group_labels(np.array([9, 9, 2, 5, 2]), 5).tolist() == [0, 0, 1, 2, 1]


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "best_fit_decreasing", "modified_first_fit_decreasing"])
def test_a_share_that_fits_one_row_is_the_packers_single_bin(algorithm: str) -> None:
    from lit_seqpack.planning.algorithms import get_packer
    from lit_seqpack.planning.rollout import rank_microbatches

    rng = np.random.default_rng(7)
    config = RolloutPlanConfig(max_tokens=4096, algorithm=algorithm)
    for _ in range(20):
        lengths = rng.integers(1, 200, 300)
        samples = rng.choice(300, size=int(rng.integers(1, 20)), replace=False)
        expected = [samples[b].tolist() for b in get_packer(algorithm, 4096).pack(lengths[samples])]
        assert rank_microbatches(samples, np.ones(samples.size, int), lengths, config) == expected == [expected[0]]
