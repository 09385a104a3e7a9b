"""GRPO groups in a rollout plan: ``keep_together="rank"`` deals whole groups to ranks and packs their samples one by
one (a group larger than one microbatch is fine); ``"microbatch"`` keeps a group in one microbatch; both refuse, by
name, a group that cannot fit what they promise."""

from __future__ import annotations

import numpy as np
import pytest

from lit_seqpack.planning.rollout import RolloutPlanConfig, plan_rollout

GROUP = 8
BUDGET = 8192


def grpo_rollout(samples: int, seed: int = 0, median: float = 512, top: int = BUDGET) -> tuple[np.ndarray, np.ndarray]:
    """Lognormal response lengths (median ``median``, sigma 0.8, in [16, top]) in GRPO groups of 8 samples."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), 0.8, samples)), 16, top).astype(np.int64)
    groups = np.repeat(rng.permutation(samples // GROUP) * 3 + 1, GROUP)  # sparse, shuffled group ids
    return lengths, groups


def check_plan(plan, lengths: np.ndarray, groups: np.ndarray, keep: str) -> None:
    """Every sample once, each group on one rank (one microbatch for keep='microbatch'), lock step, budget kept."""
    seen = sorted(i for step in plan.microbatches for rank in step for mb in rank for i in mb)
    assert seen == list(range(lengths.size))
    config = plan.config
    for step in plan.microbatches:
        assert len(step) == config.world_size
        assert {len(rank) for rank in step} == {plan.accumulate_grad_batches}
        where: dict[int, set[tuple[int, int]]] = {}
        for r, rank in enumerate(step):
            for j, mb in enumerate(rank):
                rows = lengths[mb]
                used = rows.sum() if config.mode == "packing" else len(mb) * rows.max(initial=0)
                assert used <= config.max_tokens
                for i in mb:
                    where.setdefault(int(groups[i]), set()).add((r, j))
        assert all(len({r for r, _ in places}) == 1 for places in where.values())  # no group across ranks
        if keep == "microbatch":
            assert all(len(places) == 1 for places in where.values())


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize(("samples", "ranks"), [(512, 8), (4096, 64)])
def test_rank_keeps_grpo_groups_of_8_on_one_rank(mode: str, samples: int, ranks: int) -> None:
    lengths, groups = grpo_rollout(samples, seed=ranks)
    config = RolloutPlanConfig(
        max_tokens=BUDGET, mode=mode, world_size=ranks, samples_per_step=samples // 2, keep_together="rank"
    )
    plan = plan_rollout(lengths, config, group_ids=groups)
    check_plan(plan, lengths, groups, "rank")
    totals = np.bincount(np.unique(groups, return_inverse=True)[1], weights=lengths)
    assert totals.max() > BUDGET  # some groups are larger than one microbatch: they span several
    spans = [
        len({j for j, mb in enumerate(rank) if any(groups[i] == g for i in mb)})
        for step in plan.microbatches
        for rank in step
        for g in {int(groups[i]) for mb in rank for i in mb}
    ]
    assert max(spans) > 1
    assert plan.num_steps == 2 and plan.step_documents.tolist() == [samples // 2] * 2


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize(("samples", "ranks"), [(512, 8), (4096, 64)])
def test_microbatch_keeps_grpo_groups_of_8_in_one_microbatch(mode: str, samples: int, ranks: int) -> None:
    lengths, groups = grpo_rollout(samples, seed=ranks, median=128, top=BUDGET // (4 * GROUP))  # groups that fit
    config = RolloutPlanConfig(
        max_tokens=BUDGET, mode=mode, world_size=ranks, samples_per_step=samples // 2, keep_together="microbatch"
    )
    check_plan(plan_rollout(lengths, config, group_ids=groups), lengths, groups, "microbatch")


def test_rank_plans_a_group_larger_than_one_row() -> None:
    config = RolloutPlanConfig(max_tokens=8, world_size=1, keep_together="rank")
    assert plan_rollout([5, 5, 5], config, group_ids=[0, 0, 0]).microbatches == [[[[0], [1], [2]]]]


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_rank_refuses_a_group_larger_than_a_ranks_whole_step_naming_it(mode: str) -> None:
    lengths, groups = [5, 5, 5, 3, 3], [4, 4, 4, 9, 9]
    config = RolloutPlanConfig(max_tokens=8, mode=mode, world_size=2, keep_together="rank", accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"keep_together='rank': group 4 \(samples \[0, 1, 2\]\) has 15 tokens"):
        plan_rollout(lengths, config, group_ids=groups)
    plan_rollout(
        lengths, RolloutPlanConfig(max_tokens=8, mode=mode, world_size=2, keep_together="rank"), group_ids=groups
    )


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_microbatch_refuses_a_group_larger_than_a_row_naming_it(mode: str) -> None:
    lengths, groups = grpo_rollout(512, seed=8)
    config = RolloutPlanConfig(max_tokens=BUDGET, mode=mode, world_size=2, keep_together="microbatch")
    with pytest.raises(ValueError, match=r"keep_together='microbatch': group \d+ \(samples \[\d+, .*> max_tokens=8192"):
        plan_rollout(lengths, config, group_ids=groups)
