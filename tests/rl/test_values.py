"""PPO's value path: values through the packed forward equal each sample alone, GAE equals a textbook loop (holes
in the response, samples without a loss), and the clipped critic loss equals one big padded batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lit_seqpack.rl import RolloutPlanner, gae, value_loss
from lit_seqpack.rl.values import token_values
from tests._limits import TEST_TIMEOUT_S
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match
from tests.rl._critic import Critic, alone_values, padded_critic_gradients, ppo_rollout, textbook_gae
from tests.rl._policies import RolloutBatches
from tests.rl.test_ddp import ddp_spawn_trainer as ddp_trainer


def critic_rollout(critic: Critic, mode: str, seed: int = 0):
    """The rollout with the critic's old values (through the planner), GAE advantages and returns."""
    rollout = ppo_rollout(seed=seed)
    planner = RolloutPlanner(train_max_tokens=48, mode=mode, world_size=1, rank=0)
    with torch.no_grad():
        values = planner.compute_per_token(critic.values, rollout)
    gen = torch.Generator().manual_seed(seed)
    old = [v + 0.2 * torch.randn(v.shape, generator=gen) for v in values]  # the critic moved: some clip
    advantages, returns = gae(rollout.token_fields["rewards"], old, rollout.loss_mask, gamma=0.99, lam=0.9)
    fields = {"old_values": old, "advantages": advantages, "returns": returns}
    return rollout.with_fields(token_fields=fields), values


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_values_through_the_planner_equal_each_sample_alone(mode: str) -> None:
    torch.manual_seed(0)
    critic = Critic().eval()
    rollout, values = critic_rollout(critic, mode)
    for index, (got, want) in enumerate(zip(values, alone_values(critic, rollout), strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"sample {index}")


def test_gae_equals_the_textbook_loop() -> None:
    rollout = ppo_rollout(seed=3)
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(len(ids), generator=gen) for ids in rollout.input_ids]
    rewards, masks = rollout.token_fields["rewards"], rollout.loss_mask
    assert any(bool((m[m.nonzero().min() :] == 0).any()) for m in masks if m.any())  # a hole in some response
    assert rollout.zero_loss_samples == 2
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        advantages, returns = gae(rewards, values, masks, gamma=gamma, lam=lam)
        expected_adv, expected_ret = textbook_gae(rewards, values, masks, gamma, lam)
        for a, b in zip(advantages + returns, expected_adv + expected_ret, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    full, _ = gae(rewards, values, masks, gamma=1.0, lam=1.0)  # lam = gamma = 1: reward-to-go minus the value
    i = 0
    on = masks[i].nonzero().flatten()
    torch.testing.assert_close(full[i][on[0]], rewards[i][on].sum() - values[i][on[0]], rtol=1e-6, atol=1e-6)


def test_value_helpers_check_their_inputs() -> None:
    assert token_values(torch.ones(1, 3, 1)).tolist() == [[0.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match=r"must be \[B, T\] or \[B, T, 1\]"):
        token_values(torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), clip=0.0)
    with pytest.raises(ValueError, match="sample 0: rewards"):
        gae([torch.zeros(2)], [torch.zeros(3)], [torch.tensor([0, 1, 1])])


@pytest.mark.parametrize(("normalize", "mode"), [("token", "packing"), ("sequence", "dynamic"), ("group", "packing")])
def test_the_clipped_critic_loss_equals_the_big_padded_batch(normalize: str, mode: str) -> None:
    torch.manual_seed(0)
    critic = Critic(normalize)
    rollout, _ = critic_rollout(critic, mode)
    planner = RolloutPlanner(train_max_tokens=48, mode=mode, accumulate_grad_batches=5, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    expected = padded_critic_gradients(critic, rollout, list(range(len(rollout))), normalize)
    capture = GradientCapture()
    Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=1,
        accumulate_grad_batches=5,
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(critic, torch.utils.data.DataLoader(batches, batch_size=None))
    assert_gradients_match(capture.grads, expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_critic_loss_on_two_ranks_equals_the_big_padded_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    critic = Critic("group")
    rollout, _ = critic_rollout(critic, "packing", seed=1)
    kwargs = {"train_max_tokens": 48, "mode": "packing", "accumulate_grad_batches": 4}
    expected = padded_critic_gradients(critic, rollout, list(range(len(rollout))), "group")
    path = tmp_path / "grads.pt"
    ddp_trainer(accumulate_grad_batches=4, callbacks=[GradientCapture(str(path))]).fit(
        critic, datamodule=RolloutBatches(rollout, kwargs)
    )
    assert_gradients_match(torch.load(path), expected, rtol=1e-5)
