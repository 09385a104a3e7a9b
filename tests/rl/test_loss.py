"""Exact policy losses: one optimizer step of a clipped policy-gradient loss over packed or dynamic microbatches
(gradient accumulation) equals the same loss on one big padded batch, for token-, sequence- and group-mean, under
automatic (Lightning divides by accumulation) and manual optimization (it does not)."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.rl import RolloutPlanner, step_loss, token_logprobs
from lit_seqpack.rl.loss import loss_output, scale_step_loss
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match
from tests.rl._policies import AutomaticPolicy, ManualPolicy, cpu_trainer, one_item_loader, prefixed
from tests.rl._rollouts import (
    make_policy,
    make_rollout,
    padded_reference_gradients,
    with_loss_weights,
    with_policy_fields,
)

NORMALIZE = ["token", "sequence", "group"]


def policy_rollout(seed: int = 0):
    reference = make_policy("reference", seed=seed)
    rollout = with_policy_fields(reference, make_rollout(count=12, seed=seed, group_size=3), seed=seed)
    return reference, rollout


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_automatic_step_equals_the_big_padded_batch(normalize: str, mode: str) -> None:
    _, rollout = policy_rollout()
    torch.manual_seed(0)
    module = AutomaticPolicy(normalize)
    planner = RolloutPlanner(train_max_tokens=48, mode=mode, accumulate_grad_batches=6, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    assert len(batches) == 6 and len({b["num_loss_tokens"] for b in batches}) > 1
    expected = padded_reference_gradients(module, rollout, [list(range(len(rollout)))], normalize)
    capture = GradientCapture()
    cpu_trainer(accumulate_grad_batches=6, callbacks=[capture]).fit(
        module, torch.utils.data.DataLoader(batches, batch_size=None)
    )
    assert_gradients_match(capture.grads, prefixed(expected), rtol=1e-5)


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_manual_steps_equal_the_big_padded_batch_of_each_step(normalize: str, mode: str) -> None:
    _, rollout = policy_rollout(seed=1)
    kwargs = {"train_max_tokens": 40, "mode": mode, "steps_per_rollout": 2}
    torch.manual_seed(1)
    module = ManualPolicy(normalize, rollout, kwargs)
    plan = RolloutPlanner(**kwargs, world_size=1, rank=0).plan(rollout)
    assert plan.num_steps == 2 and plan.accumulate_grad_batches > 1
    first_step = [i for step, _, mb in plan.rank_microbatches(0) if step == 0 for i in mb]
    expected = padded_reference_gradients(module, rollout, [sorted(first_step)], normalize)
    cpu_trainer().fit(module, one_item_loader())
    assert len(module.step_gradients) == 2  # the rollout's exact number of optimizer steps
    assert_gradients_match(module.step_gradients[0], prefixed(expected), rtol=1e-5)


def test_automatic_scaling_under_manual_optimization_is_measurably_wrong() -> None:
    """Negative control: the accumulation factor matters, so the comparison above can fail."""
    _, rollout = policy_rollout()
    batch = next(
        RolloutPlanner(train_max_tokens=48, accumulate_grad_batches=4, world_size=1, rank=0).train_microbatches(rollout)
    )
    token_loss = torch.ones(batch["labels"].shape, requires_grad=True)
    automatic = step_loss(token_loss, batch, normalize="token", optimization="automatic")
    manual = step_loss(token_loss, batch, normalize="token", optimization="manual")
    assert automatic.item() == pytest.approx(4 * manual.item())
    assert manual.item() == pytest.approx(batch["num_loss_tokens"] / batch["step_loss_tokens"])


def test_normalisations_weigh_documents_as_documented() -> None:
    from lit_seqpack.rl import Rollout

    rollout = Rollout(input_ids=[[1, 2, 3, 4], [5, 6]], group_ids=[0, 0])  # 3 and 1 loss tokens, one group
    batch = next(RolloutPlanner(train_max_tokens=16, world_size=1, rank=0).train_microbatches(rollout))
    ones = torch.ones(batch["labels"].shape)
    assert loss_output(ones, batch, normalize="token").loss_sum.item() == pytest.approx(4.0)  # 4 loss tokens
    assert loss_output(ones, batch, normalize="sequence").loss_sum.item() == pytest.approx(2.0)  # 1 + 1
    assert loss_output(ones, batch, normalize="group").loss_sum.item() == pytest.approx(1.0)  # 4 / 4
    nan_off_mask = torch.where(batch["labels"] == -100, float("nan"), 1.0)
    assert loss_output(nan_off_mask, batch, normalize="token").loss_sum.item() == pytest.approx(4.0)


def test_loss_helpers_name_what_is_missing() -> None:
    from lit_seqpack.data.batching.collate import PackedCollator

    batch = PackedCollator()([{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match="RolloutPlanner.train_microbatches"):
        loss_output(torch.zeros(1, 3), batch, normalize="token")
    rollout_batch = next(RolloutPlanner(train_max_tokens=64, world_size=1, rank=0).train_microbatches(make_rollout(2)))
    with pytest.raises(ValueError, match="normalize must be one of"):
        loss_output(torch.zeros(rollout_batch["labels"].shape), rollout_batch, normalize="tokens")
    out = loss_output(torch.zeros(rollout_batch["labels"].shape), rollout_batch, normalize="token")
    with pytest.raises(ValueError, match="optimization must be 'automatic' or 'manual'"):
        scale_step_loss(out, rollout_batch)


def test_token_logprobs_score_the_labelled_token_from_the_previous_position() -> None:
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, 1, -100, 6], [-100, 0, 2, 5, -100]])
    got = token_logprobs(logits, labels)
    expected = torch.zeros(2, 5, dtype=torch.float64)
    for b in range(2):
        for t in range(1, 5):
            if labels[b, t] != -100:
                expected[b, t] = logits[b, t - 1].log_softmax(-1)[labels[b, t]]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def weighted_rollout(seed: int = 0):
    _, rollout = policy_rollout(seed)
    return with_loss_weights(rollout, seed=seed)


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_weighted_automatic_step_equals_the_big_padded_batch(normalize: str, mode: str) -> None:
    rollout = weighted_rollout()
    torch.manual_seed(0)
    module = AutomaticPolicy(normalize)
    planner = RolloutPlanner(
        train_max_tokens=48, mode=mode, accumulate_grad_batches=6, loss_weight_field="weights", world_size=1, rank=0
    )
    batches = list(planner.train_microbatches(rollout))
    assert len({round(b["num_loss_weight"], 6) for b in batches}) > 1
    expected = padded_reference_gradients(module, rollout, [list(range(len(rollout)))], normalize, "weights")
    unweighted = padded_reference_gradients(module, rollout, [list(range(len(rollout)))], normalize)
    with pytest.raises(AssertionError):  # the weights change the gradient: the comparison below can fail
        assert_gradients_match(unweighted, expected, rtol=1e-3)
    capture = GradientCapture()
    cpu_trainer(accumulate_grad_batches=6, callbacks=[capture]).fit(
        module, torch.utils.data.DataLoader(batches, batch_size=None)
    )
    assert_gradients_match(capture.grads, prefixed(expected), rtol=1e-5)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_weighted_manual_steps_equal_the_big_padded_batch_of_each_step(mode: str) -> None:
    rollout = weighted_rollout(seed=1)
    kwargs = {"train_max_tokens": 40, "mode": mode, "steps_per_rollout": 2, "loss_weight_field": "weights"}
    torch.manual_seed(1)
    module = ManualPolicy("token", rollout, kwargs)
    plan = RolloutPlanner(**kwargs, world_size=1, rank=0).plan(rollout)
    assert plan.num_steps == 2 and plan.accumulate_grad_batches > 1
    first_step = [i for step, _, mb in plan.rank_microbatches(0) if step == 0 for i in mb]
    expected = padded_reference_gradients(module, rollout, [sorted(first_step)], "token", "weights")
    cpu_trainer().fit(module, one_item_loader())
    assert len(module.step_gradients) == 2
    assert_gradients_match(module.step_gradients[0], prefixed(expected), rtol=1e-5)
