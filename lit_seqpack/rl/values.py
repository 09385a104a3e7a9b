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

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lit_seqpack.batch import IGNORE_INDEX

__all__ = ["gae", "token_values", "value_loss"]


def token_values(head: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` values aligned with the token they value: ``out[:, t] = head[:, t - 1]``, 0 at ``t = 0`` and, with
    ``labels``, wherever the label is -100 (as :func:`~lit_seqpack.rl.token_logprobs` aligns log-probabilities).

    Args:
        head: the value head's output ``[B, T]`` or ``[B, T, 1]`` (position ``t`` has seen tokens ``0..t``).
        labels: the batch's labels.

    Example:
        >>> token_values(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[-100, 5, 6]])).tolist()
        [[0.0, 1.0, 2.0]]
    """
    if head.ndim == 3 and head.shape[-1] == 1:
        head = head[..., 0]
    if head.ndim != 2:
        raise ValueError(f"the value head's output must be [B, T] or [B, T, 1], got {tuple(head.shape)}")
    shifted = F.pad(head[:, :-1], (1, 0))
    if labels is None:
        return shifted
    return torch.where(labels.to(shifted.device) != IGNORE_INDEX, shifted, torch.zeros_like(shifted))


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
