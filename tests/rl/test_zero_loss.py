"""Samples without a loss (an all-zero loss mask or all-zero loss weights: truncated, filtered or over-long
completions) are planned, counted and contribute nothing: every normalisation leaves them out exactly, against one
big padded batch, and a step where nothing has a loss is a zero-gradient step."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.rl import Rollout, RolloutPlanner
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match
from tests.rl._policies import AutomaticPolicy, ManualPolicy, cpu_trainer, one_item_loader, prefixed
from tests.rl._rollouts import (
    make_policy,
    make_rollout,
    padded_reference_gradients,
    with_loss_weights,
    with_policy_fields,
    without_loss,
)

NORMALIZE = ["token", "sequence", "group"]
SILENT = [0, 1, 2, 7]  # group 0 (samples 0-2) has no loss at all; sample 7 of group 2 has none
KWARGS = {"train_max_tokens": 48, "steps_per_rollout": 2, "world_size": 2}


def silent_rollout(seed: int = 0, silent: list[int] = SILENT) -> Rollout:
    reference = make_policy("reference", seed=seed)
    rollout = with_policy_fields(reference, make_rollout(count=12, seed=seed, group_size=3), seed=seed)
    return without_loss(rollout, silent)


def test_a_rollout_counts_its_samples_without_loss_and_the_batches_count_them() -> None:
    rollout = silent_rollout()
    assert rollout.zero_loss_samples == 4 and rollout.loss_tokens[SILENT].tolist() == [0, 0, 0, 0]
    batches = [b for r in range(2) for b in RolloutPlanner(**KWARGS, rank=r).train_microbatches(rollout)]
    for step in range(2):
        mine = [b for b in batches if b["step"] == step]
        samples = [i for b in mine for i in b["sample_indices"]]
        with_loss = [i for i in samples if i not in SILENT]
        groups = {int(rollout.group_ids[i]) for i in with_loss}
        assert {b["step_loss_documents"] for b in mine} == {len(with_loss)}
        assert {b["step_loss_groups"] for b in mine} == {len(groups)}
        assert sum(b["num_loss_documents"] for b in mine) == len(with_loss)
        assert all(b["num_loss_documents"] <= b["num_documents"] for b in mine)
    assert sorted(i for b in batches for i in b["sample_indices"]) == list(range(12))  # planned all the same


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_samples_without_loss_are_left_out_of_every_mean(normalize: str, mode: str) -> None:
    rollout = silent_rollout()
    torch.manual_seed(0)
    module = AutomaticPolicy(normalize)
    planner = RolloutPlanner(train_max_tokens=48, mode=mode, accumulate_grad_batches=6, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    everything = [list(range(len(rollout)))]
    expected = padded_reference_gradients(module, rollout, everything, normalize)
    capture = GradientCapture()
    cpu_trainer(accumulate_grad_batches=6, callbacks=[capture]).fit(
        module, torch.utils.data.DataLoader(batches, batch_size=None)
    )
    assert_gradients_match(capture.grads, prefixed(expected), rtol=1e-5)
    if normalize != "token":  # negative control: a mean that counted the silent samples would be measurably smaller
        counted = 8 / 12 if normalize == "sequence" else 3 / 4  # samples, groups with a loss over all of them
        with pytest.raises(AssertionError):
            assert_gradients_match(capture.grads, prefixed({k: v * counted for k, v in expected.items()}), rtol=1e-5)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_samples_with_all_zero_weights_are_left_out_of_every_mean(normalize: str) -> None:
    rollout = with_loss_weights(silent_rollout(silent=[]), seed=4)
    zeroed = [torch.zeros_like(w) if i in SILENT else w for i, w in enumerate(rollout.token_fields["weights"])]
    rollout = rollout.with_fields(token_fields={"weights": zeroed})
    kwargs = {"train_max_tokens": 40, "steps_per_rollout": 2, "loss_weight_field": "weights"}
    torch.manual_seed(2)
    module = ManualPolicy(normalize, rollout, kwargs)
    plan = RolloutPlanner(**kwargs, world_size=1, rank=0).plan(rollout)
    first_step = sorted(i for step, _, mb in plan.rank_microbatches(0) if step == 0 for i in mb)
    assert set(SILENT) & set(first_step)
    expected = padded_reference_gradients(module, rollout, [first_step], normalize, "weights")
    cpu_trainer().fit(module, one_item_loader())
    assert_gradients_match(module.step_gradients[0], prefixed(expected), rtol=1e-5)


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_a_step_where_nothing_has_a_loss_has_a_zero_gradient(normalize: str, optimization: str) -> None:
    rollout = silent_rollout(silent=list(range(6)))  # the first step (groups 0 and 1) has no loss at all
    kwargs = {"train_max_tokens": 40, "samples_per_step": 6}
    torch.manual_seed(3)
    if optimization == "manual":
        module = ManualPolicy(normalize, rollout, kwargs)
        cpu_trainer().fit(module, one_item_loader())
        first, second = module.step_gradients[0], module.step_gradients[1]
    else:
        module = AutomaticPolicy(normalize)
        batches = list(
            RolloutPlanner(**kwargs, accumulate_grad_batches=4, world_size=1, rank=0).train_microbatches(rollout)
        )
        capture = GradientCapture()
        cpu_trainer(accumulate_grad_batches=4, callbacks=[capture]).fit(
            module, torch.utils.data.DataLoader(batches[:4], batch_size=None)
        )
        first, second = capture.grads, None
    assert all(torch.equal(g, torch.zeros_like(g)) for g in first.values())  # zeros, not NaN
    if second is not None:  # the next step, with losses, does move the weights
        assert any(bool(g.abs().max() > 0) for g in second.values())
