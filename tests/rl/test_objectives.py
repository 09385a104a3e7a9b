"""The objective helpers: each formula against a direct computation, the entropy's values and gradient against the
full log-softmax, GSPO's sequence ratio on packed rows against each sample alone, and a loss that uses all of them
equal to one big padded batch (gradients to 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_seqpack.rl import RolloutPlanner, clipped_policy_loss, kl_estimate, token_entropy, truncated_importance_weights
from lit_seqpack.rl.objectives import sequence_log_ratio, temperature_scaled
from lit_seqpack.rl.unpack import unpack
from tests._limits import TEST_TIMEOUT_S
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match
from tests.rl._objectives import ObjectivePolicy, padded_objective_gradients, with_objective_fields
from tests.rl._policies import RolloutBatches, cpu_trainer, prefixed
from tests.rl._rollouts import make_policy, make_rollout, with_policy_fields, without_loss
from tests.rl.test_ddp import ddp_spawn_trainer as ddp_trainer


def test_kl_estimators_follow_their_formulas_and_k1_k3_are_unbiased() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, ref = p.log()[tokens], q.log()[tokens]
    r = ref - lp
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), -r)
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), r.square() / 2)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), r.exp() - 1 - r)
    assert float(kl_estimate(lp, ref, "k3").min()) >= 0
    assert kl_estimate(lp, ref, "k1").mean().item() == pytest.approx(exact, rel=0.02)
    assert kl_estimate(lp, ref, "k3").mean().item() == pytest.approx(exact, rel=0.02)
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_estimate(lp, ref, "k4")


def test_token_entropy_equals_the_full_log_softmax_with_its_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 9, 50, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=gen)
    labels[0, :3] = -100
    weights = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    got = token_entropy(logits, labels, chunk=4)  # chunks that do not divide the 18 rows
    log_p = logits.log_softmax(-1)
    full = torch.nn.functional.pad(-(log_p.exp() * log_p).sum(-1)[:, :-1], (1, 0))
    expected = torch.where(labels != -100, full, 0.0)
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad((got.double() * weights).sum(), logits)
    (want,) = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    assert token_entropy(torch.zeros(1, 3, 8))[0].tolist() == pytest.approx([0.0, 2.0794415, 2.0794415])


def test_temperature_divides_the_logits_in_place_or_not() -> None:
    logits = torch.tensor([[[2.0, 4.0]]])
    assert temperature_scaled(logits, 1.0) is logits
    assert temperature_scaled(logits, 2.0).tolist() == [[[1.0, 2.0]]] and logits.tolist() == [[[2.0, 4.0]]]
    assert temperature_scaled(logits, 2.0, inplace=True) is logits and logits.tolist() == [[[1.0, 2.0]]]
    capped = torch.tanh(torch.randn(1, 2, 3, requires_grad=True))  # tanh's backward needs its output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        temperature_scaled(capped, 2.0, inplace=True).sum().backward()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        temperature_scaled(logits, 0.0)


def test_truncated_importance_weights_are_capped_ratios_without_grad() -> None:
    logprobs = torch.tensor([0.0, -0.5, 1.0], requires_grad=True)
    weights = truncated_importance_weights(logprobs, torch.zeros(3), cap=2.0)
    assert weights.tolist() == pytest.approx([1.0, float(torch.tensor(-0.5).exp()), 2.0])
    assert not weights.requires_grad


def test_dual_clip_caps_the_loss_of_negative_advantages_only() -> None:
    logprobs, old = torch.tensor([2.0, 2.0, 0.05]), torch.zeros(3)
    advantages = torch.tensor([-1.0, 1.0, -1.0])
    plain = clipped_policy_loss(logprobs, old, advantages)
    dual = clipped_policy_loss(logprobs, old, advantages, dual_clip=3.0)
    assert plain[0].item() == pytest.approx(float(torch.tensor(2.0).exp()))  # r = 7.39: -r A unbounded
    assert dual.tolist() == pytest.approx([3.0, plain[1].item(), plain[2].item()])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_policy_loss(logprobs, old, advantages, dual_clip=1.0)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_the_sequence_log_ratio_of_a_packed_batch_is_each_samples_own(mode: str) -> None:
    rollout = make_rollout(count=9, seed=5)
    gen = torch.Generator().manual_seed(5)
    lp = [torch.randn(n, generator=gen) for n in rollout.lengths.tolist()]
    old = [torch.randn(n, generator=gen) for n in rollout.lengths.tolist()]
    rollout = rollout.with_fields(token_fields={"lp": lp, "old": old})
    budget = 9 * int(rollout.lengths.max())  # one batch of all 9 samples in either mode
    (batch,) = RolloutPlanner(train_max_tokens=budget, mode=mode, world_size=1, rank=0).train_microbatches(rollout)
    assert batch["num_documents"] == 9
    values = unpack(sequence_log_ratio(batch["lp"], batch["old"], batch), batch)
    for i, got in zip(batch["sample_indices"], values, strict=True):
        mask = rollout.loss_mask[i]
        want = torch.where(mask, (lp[i] - old[i])[mask].mean(), torch.tensor(0.0))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def objective_rollout(seed: int = 0):
    reference = make_policy("reference", seed=seed)
    rollout = with_policy_fields(reference, make_rollout(count=12, seed=seed, group_size=3), seed=seed)
    return without_loss(with_objective_fields(reference, rollout, seed=seed), [4, 9])


@pytest.mark.parametrize(
    ("normalize", "mode", "gspo"),
    [
        ("token", "packing", False),
        ("sequence", "dynamic", False),
        ("group", "packing", True),
        ("token", "dynamic", True),
    ],
)
def test_a_loss_with_every_objective_equals_the_big_padded_batch(normalize: str, mode: str, gspo: bool) -> None:
    rollout = objective_rollout()
    torch.manual_seed(0)
    module = ObjectivePolicy(normalize, gspo=gspo)
    planner = RolloutPlanner(train_max_tokens=48, mode=mode, accumulate_grad_batches=6, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    expected = padded_objective_gradients(module, rollout, list(range(len(rollout))), normalize, gspo=gspo)
    capture = GradientCapture()
    cpu_trainer(accumulate_grad_batches=6, callbacks=[capture]).fit(
        module, torch.utils.data.DataLoader(batches, batch_size=None)
    )
    assert_gradients_match(capture.grads, prefixed(expected), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("normalize", "mode", "gspo"), [("token", "packing", False), ("group", "dynamic", True)])
def test_every_objective_on_two_ranks_equals_the_big_padded_batch(
    normalize: str, mode: str, gspo: bool, tmp_path: Path
) -> None:
    """Temperature, truncated importance sampling, dual clip, k3 KL, entropy (and GSPO's ratio), with samples
    without a loss, through Lightning's DDP on 2 gloo ranks."""
    rollout = objective_rollout(seed=1)
    kwargs = {"train_max_tokens": 48, "mode": mode, "accumulate_grad_batches": 4}
    torch.manual_seed(0)
    module = ObjectivePolicy(normalize, gspo=gspo)
    expected = padded_objective_gradients(module, rollout, list(range(len(rollout))), normalize, gspo=gspo)
    path = tmp_path / "grads.pt"
    ddp_trainer(accumulate_grad_batches=4, callbacks=[GradientCapture(str(path))]).fit(
        module, datamodule=RolloutBatches(rollout, kwargs)
    )
    assert_gradients_match(torch.load(path), prefixed(expected), rtol=1e-5)
