"""Outcome advantage estimators against a reference written here sample by sample in float64 (verl's definitions:
group mean / unbiased std, leave-one-out, REINFORCE++'s whitening over every response token), spread over the
tokens of packed and dynamic batches; DAPO's group filter and overlong penalty."""

from __future__ import annotations

import math

import pytest
import torch

from lit_seqpack.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantages,
    filter_groups,
    overlong_penalty,
    spread_over_tokens,
)
from lit_seqpack.rl.planner import RolloutPlanner
from lit_seqpack.rl.unpack import unpack
from tests.rl._rollouts import make_rollout

EPS = 1e-6


def reference(rewards: list[float], groups: list[int], tokens: list[int], estimator: str) -> list[float]:
    """Each sample's advantage, one at a time, in float64 (a lone sample has no baseline: 0 for GRPO and RLOO)."""
    members = {g: [i for i, h in enumerate(groups) if h == g] for g in set(groups)}
    out = []
    for i, r in enumerate(rewards):
        mine = [rewards[j] for j in members[groups[i]]]
        n, mean = len(mine), sum(mine) / len(mine)
        std = math.sqrt(sum((x - mean) ** 2 for x in mine) / (n - 1)) if n > 1 else 0.0
        if estimator == "grpo":
            out.append((r - mean) / (std + EPS) if n > 1 else 0.0)
        elif estimator in ("grpo_no_std", "dr_grpo"):
            out.append(r - mean if n > 1 else 0.0)
        elif estimator == "rloo":
            out.append(r - (sum(mine) - r) / (n - 1) if n > 1 else 0.0)
        else:
            out.append(r - mean if (estimator == "reinforce_pp_baseline" and n > 1) else r)
    if estimator.startswith("reinforce_pp"):  # whitened over every response token: each sample repeated
        flat = [a for a, t in zip(out, tokens, strict=True) for _ in range(t)]
        mean = sum(flat) / len(flat)
        var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
        out = [(a - mean) / math.sqrt(var + 1e-8) if t else 0.0 for a, t in zip(out, tokens, strict=True)]
    return out


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_estimators_equal_the_per_sample_reference(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4]  # group 2 has one sample; group 4 all-equal rewards
    rewards = torch.rand(len(groups), generator=gen, dtype=torch.float64)
    rewards[10:] = 0.5
    tokens = [int(t) for t in torch.randint(0, 9, (len(groups),), generator=gen)]
    got = advantages(rewards, groups, estimator=estimator, token_counts=tokens)
    want = reference(rewards.tolist(), groups, tokens, estimator)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    if estimator in ("grpo", "grpo_no_std", "dr_grpo", "rloo"):
        assert got[7].item() == 0.0 and got[10:].abs().max().item() == 0.0  # a lone sample, an all-equal group


def test_reinforce_pp_without_token_counts_whitens_over_samples() -> None:
    rewards = torch.tensor([1.0, 2.0, 4.0])
    got = advantages(rewards, estimator="reinforce_pp")
    want = (rewards.double() - rewards.double().mean()) / torch.sqrt(rewards.double().var() + 1e-8)
    torch.testing.assert_close(got, want.float())
    assert got.dtype == torch.float32


def test_bad_estimator_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="estimator must be one of"):
        advantages(torch.zeros(2), [0, 0], estimator="ppo")
    with pytest.raises(ValueError, match="needs group_ids"):
        advantages(torch.zeros(2), estimator="grpo")
    with pytest.raises(ValueError, match="sample 1 has nan"):
        advantages(torch.tensor([0.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="group_ids has 3 entries for 2 rewards"):
        advantages(torch.zeros(2), [0, 0, 1])


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_spread_advantages_reach_every_response_token_of_the_batches(mode: str) -> None:
    rollout = make_rollout(count=10, seed=3, group_size=3)  # the last group has one sample
    rewards = torch.rand(len(rollout), generator=torch.Generator().manual_seed(1))
    adv = advantages(rewards, rollout.group_ids, estimator="grpo")
    assert adv[9].item() == 0.0
    rollout = rollout.with_fields(token_fields={"advantages": spread_over_tokens(adv, rollout)})
    seen = set()
    for batch in RolloutPlanner(train_max_tokens=40, mode=mode, world_size=1, rank=0).train_microbatches(rollout):
        for index, values in zip(batch["sample_indices"], unpack(batch["advantages"], batch), strict=True):
            mask = rollout.loss_mask[index]
            assert torch.equal(values[mask], torch.full((int(mask.sum()),), float(adv[index])))
            assert not values[~mask].any()
            seen.add(int(index))
    assert seen == set(range(len(rollout)))


def test_filter_groups_drops_and_counts_groups_with_equal_rewards() -> None:
    rollout = make_rollout(count=9, seed=4, group_size=2)  # groups 0..3 of two, group 4 of one
    rollout = rollout.with_fields(sample_fields={"score": torch.arange(9.0)})
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.3, 0.7])
    result = filter_groups(rollout, rewards)
    assert result.kept.tolist() == [2, 3, 6, 7]
    assert (result.dropped_groups, result.dropped_samples) == (3, 5)
    assert result.rollout.sample_fields["score"].tolist() == [2.0, 3.0, 6.0, 7.0]
    pairs = zip(result.rollout.input_ids, [2, 3, 6, 7], strict=True)
    assert all(torch.equal(ids, rollout.input_ids[i]) for ids, i in pairs)
    assert filter_groups(rollout, torch.zeros(9)).rollout is None
    with pytest.raises(ValueError, match="needs the rollout's group_ids"):
        filter_groups(make_rollout(count=2), torch.zeros(2))


def test_overlong_penalty_is_dapos_linear_ramp() -> None:
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, max_length=20, buffer=6, factor=0.5)
    want = [min(-(n - 14) / 6 * 0.5, 0.0) for n in range(25)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty(lengths, max_length=20, buffer=0)
