"""PPO's value path: per-token values through the packed forward, GAE per sample, and an exact critic loss.

A critic (a value head on any :class:`~lit_seqpack.model.mixin.PackedSequenceMixin` model) outputs one number per
position; :func:`token_values` aligns it with the token it values (the ``labels`` convention: ``values[:, t]`` is
``V`` of the state that produced token ``t``, read at position ``t - 1``). The old values come from
:meth:`~lit_seqpack.rl.RolloutPlanner.compute_per_token` (unpacked, in the rollout's order), :func:`gae` turns them
and per-token rewards into advantages and returns per sample, and :func:`value_loss` is a per-token loss that
:func:`~lit_seqpack.rl.step_loss` normalises exactly::

    values = lambda b: token_values(critic_head(b), b["labels"])
    old_values = planner.compute_per_token(values, rollout, gather=True)
    advantages, returns = gae(token_rewards, old_values, rollout.loss_mask, gamma=1.0, lam=0.95)
    rollout = rollout.with_fields(token_fields={"old_values": old_values, "advantages": advantages, "returns": returns})
    ...
    critic_loss = value_loss(values(batch), batch["old_values"], batch["returns"], clip=0.2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from lit_seqpack.rl.objectives import kl_estimate, shift_to_token

__all__ = ["AdaptiveKLController", "FixedKLController", "gae", "kl_in_reward", "token_values", "value_loss"]


def token_values(head: Any, labels_or_batch: torch.Tensor | Mapping[str, Any] | None = None) -> torch.Tensor:
    """``[B, T]`` values aligned with the token they value: ``out[:, t] = head[:, t - 1]``, 0 at ``t = 0`` and:
    given the batch, at every document's first position and on padding (never the previous document's last value
    on a packed row), with or without labels; given a labels tensor, wherever the label is -100 (as
    :func:`~lit_seqpack.rl.token_logprobs` aligns log-probabilities).

    Args:
        head: the value head's output ``[B, T]`` or ``[B, T, 1]`` (position ``t`` has seen tokens ``0..t``).
        labels_or_batch: the batch, or its labels.

    Example:
        >>> token_values(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[-100, 5, 6]])).tolist()
        [[0.0, 1.0, 2.0]]
    """
    if head.ndim == 3 and head.shape[-1] == 1:
        head = head[..., 0]
    if head.ndim != 2:
        raise ValueError(f"the value head's output must be [B, T] or [B, T, 1], got {tuple(head.shape)}")
    return shift_to_token(head, labels_or_batch)


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    loss_mask: Sequence[torch.Tensor],
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per sample, over its loss-mask tokens (its actions), in float64.

    For the actions ``a_1..a_K`` of a sample (positions where the mask is 1, in order; positions off the mask, such
    as a tool's output inside a multi-turn response, are skipped), with rewards ``r_k`` and values ``V_k``
    (``V_{K+1} = 0``: the episode ends)::

        delta_k = r_k + gamma * V_{k+1} - V_k        A_k = delta_k + gamma * lam * A_{k+1}        R_k = A_k + V_k

    Args:
        rewards: per sample, a per-token reward (e.g. ``-beta * KL`` per token plus the score on the last token).
        values: per sample, the old per-token values (:func:`token_values` through ``compute_per_token``).
        loss_mask: per sample, the actions (``Rollout.loss_mask``).
        gamma: discount.
        lam: GAE's lambda.

    Returns:
        ``(advantages, returns)``: per sample, float32 tensors shaped like its tokens, 0 off the mask.

    Example:
        >>> adv, ret = gae([torch.tensor([0.0, 0.0, 1.0])], [torch.tensor([0.0, 0.5, 0.5])], [torch.tensor([0, 1, 1])])
        >>> [round(v, 4) for v in adv[0].tolist()], [round(v, 4) for v in ret[0].tolist()]
        ([0.0, 0.475, 0.5], [0.0, 0.975, 1.0])
    """
    if not (len(rewards) == len(values) == len(loss_mask)):
        raise ValueError(f"rewards, values and loss_mask hold {len(rewards)}, {len(values)}, {len(loss_mask)} samples")
    masks = [torch.as_tensor(m).bool().cpu() for m in loss_mask]
    counts = [int(m.sum()) for m in masks]
    width = max(counts, default=0)
    r = torch.zeros(len(masks), width + 1, dtype=torch.float64)  # actions left-aligned, one zero column past the end
    v = torch.zeros_like(r)
    for i, (reward, value, mask) in enumerate(zip(rewards, values, masks, strict=True)):
        if reward.shape != mask.shape or value.shape != mask.shape:
            raise ValueError(f"sample {i}: rewards {tuple(reward.shape)} and values {tuple(value.shape)} must be "
                             f"shaped like its tokens {tuple(mask.shape)}")  # fmt: skip
        r[i, : counts[i]] = reward.detach().cpu().double()[mask]
        v[i, : counts[i]] = value.detach().cpu().double()[mask]
    advantages = torch.zeros_like(r)
    running = torch.zeros(len(masks), dtype=torch.float64)
    for k in range(width - 1, -1, -1):  # columns past a sample's last action hold zeros: V_{K+1} = 0, A_{K+1} = 0
        delta = r[:, k] + gamma * v[:, k + 1] - v[:, k]
        running = delta + gamma * lam * running
        advantages[:, k] = running
    returns = advantages + v
    out_adv, out_ret = [], []
    for i, mask in enumerate(masks):
        a, g = torch.zeros(mask.shape), torch.zeros(mask.shape)
        a[mask], g[mask] = advantages[i, : counts[i]].float(), returns[i, : counts[i]].float()
        out_adv.append(a)
        out_ret.append(g)
    return out_adv, out_ret


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None = None
) -> torch.Tensor:
    """Per-token critic loss ``(V - R)^2 / 2``; with ``clip = eps``, PPO's clipped form
    ``max((V - R)^2, (V_old + clamp(V - V_old, -eps, eps) - R)^2) / 2``.

    Example:
        >>> value_loss(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0]), clip=0.5).tolist()
        [0.5, 0.5]
    """
    loss = 0.5 * (values - returns).square()
    if clip is None:
        return loss
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return torch.maximum(loss, 0.5 * (clipped - returns).square())


class FixedKLController:
    """A constant KL coefficient (verl ``kl_ctrl.type: fixed``); :meth:`update` changes nothing."""

    def __init__(self, coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"coef must be >= 0, got {coef!r}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 (verl ``kl_ctrl.type: adaptive``): after each rollout,
    ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

    Example:
        >>> ctrl = AdaptiveKLController(0.1, target=0.01, horizon=100)
        >>> ctrl.update(current_kl=0.02, n_steps=10)  # twice the target: +0.2 * 10 / 100
        >>> round(ctrl.value, 6)
        0.102
    """

    def __init__(self, init_coef: float, *, target: float, horizon: float) -> None:
        if not (init_coef >= 0 and target > 0 and horizon > 0):
            raise ValueError(
                f"init_coef must be >= 0, target and horizon > 0, got {init_coef!r}, {target!r}, {horizon!r}"
            )
        self.value, self.target, self.horizon = float(init_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward the one that holds the KL at ``target``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_in_reward(
    scores: torch.Tensor | Sequence[float],
    old_logprobs: Sequence[torch.Tensor],
    ref_logprobs: Sequence[torch.Tensor],
    loss_mask: Sequence[torch.Tensor],
    controller: FixedKLController | AdaptiveKLController,
    *,
    estimator: Literal["k1", "k2", "k3", "abs"] = "k1",
) -> tuple[list[torch.Tensor], float]:
    """KL in the reward (PPO, REINFORCE++; verl ``use_kl_in_reward``, NeMo-RL ``use_kl_in_reward``): per sample, a
    per-token reward ``-coef * KL_t`` on every loss token plus the sample's score on its last loss token, for
    :func:`gae` (or summed for an outcome estimator), then the controller is updated with the rollout's KL.

    ``KL_t = kl_estimate(old_logprobs, ref_logprobs, estimator)`` (verl's ``apply_kl_penalty``: the behaviour
    policy's log-probs, no grad); the rollout's KL is the mean over samples of each sample's token mean, and the
    controller's ``n_steps`` is the number of samples (as verl).

    Returns:
        ``(token_rewards, current_kl)``: per sample a float32 tensor shaped like its tokens (0 off the mask), and
        the KL the controller was updated with.

    Example:
        >>> rewards, kl = kl_in_reward([1.0], [torch.tensor([0.0, -1.0, -1.0])], [torch.tensor([0.0, -1.5, -1.0])],
        ...                            [torch.tensor([0, 1, 1])], FixedKLController(0.1))
        >>> [round(v, 4) for v in rewards[0].tolist()], kl
        ([0.0, -0.05, 1.0], 0.25)
    """
    scores = torch.as_tensor(scores).detach().cpu().double().reshape(-1)
    if not (len(scores) == len(old_logprobs) == len(ref_logprobs) == len(loss_mask)):
        raise ValueError(
            f"scores, old_logprobs, ref_logprobs and loss_mask hold {len(scores)}, {len(old_logprobs)}, "
            f"{len(ref_logprobs)} and {len(loss_mask)} samples"
        )
    coef, rewards, means = controller.value, [], []
    for i, (old, ref, mask) in enumerate(zip(old_logprobs, ref_logprobs, loss_mask, strict=True)):
        on = torch.as_tensor(mask).bool().cpu()
        kl = kl_estimate(old.detach().cpu().double(), ref.detach().cpu().double(), estimator)
        kl = torch.where(on, kl, 0.0)
        reward = torch.where(on, -coef * kl, 0.0)
        positions = on.nonzero()
        if len(positions):
            reward[positions[-1]] += scores[i]
            means.append(float(kl.sum() / on.sum()))
        rewards.append(reward.float())
    current = sum(means) / len(means) if means else 0.0
    controller.update(current, n_steps=len(scores))
    return rewards, current
