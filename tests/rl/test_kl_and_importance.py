"""KL estimators (values, clamps, k3+'s gradient, the on-policy correction), KL in the reward with its controllers,
importance weights and masks (token, sequence, ICE-POP, rejection out of the normaliser, off-policy sequence mask)
and entropy / values that never read across a document boundary: against references written here per sample,
unpacked, in float64, on packed and dynamic batches."""

from __future__ import annotations

import math

import pytest
import torch

from lit_seqpack.rl.forward import policy_logits
from lit_seqpack.rl.loss import step_loss
from lit_seqpack.rl.objectives import (
    importance_mask,
    kl_estimate,
    off_policy_sequence_mask,
    sequence_importance_weights,
    token_entropy,
    truncated_importance_weights,
)
from lit_seqpack.rl.planner import RolloutPlanner
from lit_seqpack.rl.unpack import unpack
from lit_seqpack.rl.values import AdaptiveKLController, FixedKLController, kl_in_reward, token_values
from tests.rl._rollouts import make_policy, make_rollout, plain_logits, stock_model

MODES = ["packing", "dynamic"]


def kl_reference(lp: float, ref: float, estimator: str) -> float:
    d = ref - lp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    if estimator == "abs":
        return abs(d)
    d = min(max(d, -20.0), 20.0)
    return min(max(math.exp(d) - 1 - d, -10.0), 10.0)  # k3 and k3+: verl's bounds


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k3+"])
def test_kl_estimates_equal_the_formulas(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(64, generator=gen, dtype=torch.float64) * 8
    ref = -torch.rand(64, generator=gen, dtype=torch.float64) * 8
    got = kl_estimate(lp, ref, estimator)
    pairs = zip(lp.tolist(), ref.tolist(), strict=True)
    want = torch.tensor([kl_reference(a, b, estimator) for a, b in pairs], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if estimator in ("k3", "k3+"):
        assert got.max().item() == 10.0  # some estimates hit the bound
        assert kl_estimate(lp, ref, estimator, clamp=None).max().item() > 10.0


def test_k3_plus_has_k3s_value_and_k2s_gradient() -> None:
    lp = torch.tensor([-1.0, -3.0, -0.2], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -1.0, -0.2], dtype=torch.float64)
    value = kl_estimate(lp, ref, "k3+")
    torch.testing.assert_close(value, kl_estimate(lp, ref, "k3").detach())
    (grad,) = torch.autograd.grad(value.sum(), lp)
    torch.testing.assert_close(grad, lp.detach() - ref)  # d/dlp of (lp - ref)^2 / 2


def test_on_policy_correction_multiplies_by_the_detached_ratio() -> None:
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref, sampler = torch.tensor([-1.5, -1.0], dtype=torch.float64), torch.tensor([-1.2, -2.5], dtype=torch.float64)
    got = kl_estimate(lp, ref, "k3", sampler_logprobs=sampler)
    weight = (lp.detach() - sampler).exp()
    torch.testing.assert_close(got, weight * kl_estimate(lp, ref, "k3"))
    (grad,) = torch.autograd.grad(got.sum(), lp)
    (plain,) = torch.autograd.grad(kl_estimate(lp, ref, "k3").sum(), lp)
    torch.testing.assert_close(grad, weight * plain)  # the weight carries no gradient


def test_kl_in_reward_and_its_controllers() -> None:
    gen = torch.Generator().manual_seed(2)
    rollout = make_rollout(count=5, seed=2)
    old = [-torch.rand(len(ids), generator=gen) for ids in rollout.input_ids]
    ref = [-torch.rand(len(ids), generator=gen) for ids in rollout.input_ids]
    scores = torch.rand(5, generator=gen)
    controller = AdaptiveKLController(0.2, target=0.05, horizon=100)
    rewards, kl = kl_in_reward(scores, old, ref, rollout.loss_mask, controller, estimator="k1")
    means = []
    for i, mask in enumerate(rollout.loss_mask):
        on = mask.nonzero().reshape(-1).tolist()
        want = [0.0] * len(mask)
        for t in on:
            want[t] = -0.2 * (old[i][t].item() - ref[i][t].item())
        want[on[-1]] += scores[i].item()
        means.append(sum(old[i][t].item() - ref[i][t].item() for t in on) / len(on))
        torch.testing.assert_close(rewards[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert kl == pytest.approx(sum(means) / 5)
    assert controller.value == pytest.approx(0.2 * (1 + min(max(kl / 0.05 - 1, -0.2), 0.2) * 5 / 100))
    fixed = FixedKLController(0.1)
    kl_in_reward(scores, old, ref, rollout.loss_mask, fixed)
    assert fixed.value == 0.1


def batch_rollout(seed: int = 0):
    rollout = make_rollout(count=9, seed=seed, group_size=3)
    gen = torch.Generator().manual_seed(seed)
    lp = [-torch.rand(len(ids), generator=gen, dtype=torch.float64) * 2 for ids in rollout.input_ids]
    sampler = [x + 0.4 * torch.randn(len(x), generator=gen, dtype=torch.float64) for x in lp]
    adv = [torch.full((len(x),), float(torch.randn(1, generator=gen))) for x in lp]
    fields = {"lp": lp, "sampler": sampler, "adv": adv}
    return rollout.with_fields(token_fields=fields)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_weights_and_off_policy_mask_equal_each_sample_alone(mode: str) -> None:
    rollout = batch_rollout()
    for batch in RolloutPlanner(train_max_tokens=48, mode=mode, world_size=1, rank=0).train_microbatches(rollout):
        lp, sampler, adv = batch["lp"].double(), batch["sampler"].double(), batch["adv"].double()
        weights = sequence_importance_weights(lp, sampler, batch, cap=3.0, low=0.2)
        geometric = sequence_importance_weights(lp, sampler, batch, geometric=True, cap=None)
        mask = off_policy_sequence_mask(lp, sampler, adv, batch, threshold=0.1)
        for k, i in enumerate(list(batch["sample_indices"])):
            on = rollout.loss_mask[i]  # the sample alone, its fields as the batch carries them
            diff = (unpack(lp, batch)[k] - unpack(sampler, batch)[k])[on]
            total = math.exp(diff.sum().item())
            want = 0.0 if total < 0.2 else min(total, 3.0)
            got = unpack(weights, batch)[k]
            assert torch.allclose(got[on], torch.full_like(got[on], want), rtol=1e-12) and not got[~on].any()
            assert unpack(geometric, batch)[k][on].allclose(torch.tensor(math.exp(diff.mean().item())).double())
            drop = unpack(adv, batch)[k][0] < 0 and -diff.mean().item() > 0.1
            assert bool((unpack(mask, batch)[k][on] == (0.0 if drop else 1.0)).all())


def test_truncated_weights_mask_outside_the_band() -> None:
    lp = torch.log(torch.tensor([0.3, 0.6, 1.0, 1.9, 4.0], dtype=torch.float64))
    got = truncated_importance_weights(lp, torch.zeros(5, dtype=torch.float64), cap=1.5, low=0.5, high=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.6, 1.0, 1.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="low must be <= high"):
        truncated_importance_weights(lp, lp, low=2.0, high=1.0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_importance_mask_leaves_rejected_tokens_out_of_the_normaliser(level: str) -> None:
    rollout = batch_rollout(seed=1)
    low, high = (0.7, 1.4) if level != "sequence" else (0.3, 3.0)
    mask = importance_mask(
        rollout.token_fields["lp"], rollout.token_fields["sampler"], rollout.loss_mask, low=low, high=high, level=level
    )
    kept = sum(int(w.sum()) for w in mask.weights)
    assert mask.masked_tokens == int(rollout.loss_tokens.sum()) - kept and mask.masked_tokens > 0
    for w, lp, sampler, on in zip(
        mask.weights, rollout.token_fields["lp"], rollout.token_fields["sampler"], rollout.loss_mask, strict=True
    ):
        ratio = (lp - sampler).exp()
        if level == "sequence":
            ratio = torch.full_like(ratio, math.exp((lp - sampler)[on].sum().item()))
        elif level == "geometric":
            ratio = torch.full_like(ratio, math.exp((lp - sampler)[on].mean().item()))
        assert torch.equal(w.bool(), on & (ratio >= low) & (ratio <= high))
    rollout = rollout.with_fields(token_fields={"keep": mask.weights})
    planner = RolloutPlanner(train_max_tokens=48, loss_weight_field="keep", steps_per_rollout=1, world_size=1, rank=0)
    total = 0.0
    for batch in planner.train_microbatches(rollout):
        assert batch["step_loss_weight"] == kept
        total += step_loss(torch.ones(batch["labels"].shape), batch, normalize="token", optimization="manual").item()
    assert total == pytest.approx(1.0)  # the mean of ones over the kept tokens only


@pytest.mark.parametrize("mode", MODES)
def test_entropy_and_values_never_read_across_documents(mode: str) -> None:
    module = make_policy("reference")
    rollout = make_rollout(count=7, seed=5)
    model = stock_model(module)
    planner = RolloutPlanner(train_max_tokens=64, mode=mode, world_size=1, rank=0)
    with torch.no_grad():
        for batch in planner.train_microbatches(rollout):
            logits = policy_logits(module, batch)
            entropy = token_entropy(logits, batch)
            values = token_values(logits[..., 0], batch)  # any per-position output: the first logit
            for k, i in enumerate(list(batch["sample_indices"])):
                alone = plain_logits(model, rollout.input_ids[i][None])[0].double()
                log_p = alone.log_softmax(-1)
                want = torch.nn.functional.pad(-(log_p.exp() * log_p).sum(-1)[:-1], (1, 0))
                torch.testing.assert_close(unpack(entropy, batch)[k].double(), want, rtol=0, atol=1e-5)
                want_values = torch.nn.functional.pad(alone[:-1, 0], (1, 0))
                torch.testing.assert_close(unpack(values, batch)[k].double(), want_values, rtol=0, atol=1e-5)
            if mode == "packing":  # every position but the documents' first, prompt tokens included
                assert token_entropy(logits)[0, batch["cu_seqlens"][1]].item() != 0.0  # the old leak, without batch
