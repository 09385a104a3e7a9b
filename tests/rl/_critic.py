"""A tiny critic (a value head on a ReferenceLM's output) trained with the clipped value loss, the PPO value path's
ground truth (each sample alone, one big padded batch, a textbook GAE loop), and a PPO rollout with rewards."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.rl import Rollout, policy_logits, value_loss
from lit_seqpack.rl.loss import loss_output
from lit_seqpack.rl.values import token_values
from tests.rl._rollouts import TINY_REFERENCE, VOCAB, plain_logits, reference_step_mean, stock_model

VALUE_CLIP = 0.1


class Critic(ReferenceLM):
    """``V`` at every position: a linear head on the decoder's output; ``seqpack_loss`` is the clipped value loss."""

    def __init__(self, normalize: str = "token") -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.value_head = torch.nn.Linear(VOCAB, 1)
        self.normalize = normalize

    def values(self, batch: dict[str, Any]) -> torch.Tensor:
        """Per-token values of a planner batch, aligned with the tokens they value."""
        return token_values(self.value_head(policy_logits(self, batch)), batch["labels"])

    def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
        values = token_values(self.value_head(logits), batch["labels"])
        loss = value_loss(values, batch["old_values"], batch["returns"], clip=VALUE_CLIP)
        return loss_output(loss, batch, normalize=self.normalize)


def alone_values(critic: Critic, rollout: Rollout) -> list[torch.Tensor]:
    """Each sample's values, the sample run alone through the plain decoder and head (0 off the loss mask)."""
    model, out = stock_model(critic), []
    with torch.no_grad():
        for ids, mask in zip(rollout.input_ids, rollout.loss_mask, strict=True):
            labels = torch.where(mask, ids, -100)[None]
            out.append(token_values(critic.value_head(plain_logits(model, ids[None])), labels)[0])
    return out


def textbook_gae(rewards, values, masks, gamma: float, lam: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE one sample at a time, walking its actions backwards in plain Python floats."""
    advantages, returns = [], []
    for reward, value, mask in zip(rewards, values, masks, strict=True):
        where = [t for t in range(len(mask)) if mask[t]]
        adv, following_value, running = torch.zeros(len(mask)), 0.0, 0.0
        for t in reversed(where):
            delta = float(reward[t]) + gamma * following_value - float(value[t])
            running = delta + gamma * lam * running
            adv[t], following_value = running, float(value[t])
        advantages.append(adv)
        returns.append(torch.where(mask.bool(), adv + value.float(), 0.0))
    return advantages, returns


def ppo_rollout(count: int = 12, seed: int = 0) -> Rollout:
    """Rollout-like samples with a hole in some responses (a masked tool output), two without any loss, and
    per-token rewards (a small per-token penalty plus a score on the last response token)."""
    from tests.rl._rollouts import make_rollout, without_loss

    rollout = make_rollout(count=count, seed=seed, group_size=3, longest=20)
    masks = [m.clone() for m in rollout.loss_mask]
    for m in masks[::3]:
        on = m.nonzero().flatten()
        if on.numel() > 3:
            m[on[1]] = False  # a tool's output inside the response: not an action
    gen = torch.Generator().manual_seed(seed)
    rewards = []
    for m in masks:
        r = torch.where(m, -0.05 * torch.rand(m.shape, generator=gen), 0.0)
        if m.any():
            r[m.nonzero().flatten()[-1]] += float(torch.rand(1, generator=gen))
        rewards.append(r)
    rollout = Rollout(input_ids=rollout.input_ids, loss_mask=masks, group_ids=rollout.group_ids)
    return without_loss(rollout.with_fields(token_fields={"rewards": rewards}), [1, 7])


def padded_critic_gradients(critic: Critic, rollout: Rollout, samples: list[int], normalize: str) -> dict:
    """Gradient (float64) of the clipped value loss over ``samples`` as one right-padded batch."""
    model, head = stock_model(critic).double(), copy.deepcopy(critic.value_head).double()
    width = int(rollout.lengths[samples].max())
    shape = (len(samples), width)
    ids, mask, attention = (
        torch.zeros(shape, dtype=torch.long),
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape),
    )
    old, returns = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    for row, i in enumerate(samples):
        n = int(rollout.lengths[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        old[row, :n], returns[row, :n] = rollout.token_fields["old_values"][i], rollout.token_fields["returns"][i]
    values = token_values(head(plain_logits(model, ids, attention.long())), torch.where(mask, ids, -100))
    loss = torch.where(mask, value_loss(values, old, returns, clip=VALUE_CLIP), 0.0)
    groups = rollout.group_ids[samples]
    reference_step_mean(loss.sum(dim=1), mask.sum(dim=1).double(), groups, normalize).backward()
    grads = {f"model.{name}": p.grad.detach().clone() for name, p in model.named_parameters()}
    grads.update({f"value_head.{name}": p.grad.detach().clone() for name, p in head.named_parameters()})
    return grads


__all__ = ["Critic", "alone_values", "padded_critic_gradients", "ppo_rollout", "textbook_gae"]
