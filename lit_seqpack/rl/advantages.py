"""Outcome-reward advantage estimators (one registry, one pure function each), DAPO's dynamic sampling and overlong
reward shaping.

An outcome reward is one number per sample (a verifier's score, a reward model's output). :func:`advantages` turns
the rollout's rewards into one advantage per sample, in the rollout's order; :func:`spread_over_tokens` repeats each
over its sample's tokens as the ``advantages`` token field the losses read (every response token of a sample gets the
sample's advantage: verl's ``scores.unsqueeze(-1) * response_mask``)::

    rewards = rollout.sample_fields["reward"]
    adv = advantages(rewards, rollout.group_ids, estimator="grpo", token_counts=rollout.loss_tokens)
    rollout = rollout.with_fields(token_fields={"advantages": spread_over_tokens(adv, rollout)})

Every estimator is computed in float64 on the CPU, with no collective: every rank holds the whole rollout and gets
the same numbers. A group of one sample has no baseline: the GRPO variants and RLOO give it exactly 0 (verl keeps
its raw score, TRL's group std of one sample is NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from lit_seqpack.rl.rollout import Rollout

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GroupFilter",
    "advantages",
    "filter_groups",
    "overlong_penalty",
    "spread_over_tokens",
]

Estimator = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
"""Name -> estimator ``fn(rewards, groups, *, eps, token_counts)`` (float64 ``[N]`` in and out)."""


def _register(*names: str) -> Callable[[Estimator], Estimator]:
    def decorator(fn: Estimator) -> Estimator:
        for name in names:
            ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def _group_stats(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's size, mean and unbiased std (std 0 for a group of one)."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    n = counts.double()
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    mean = (sums / n)[inverse]
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (rewards - mean).square())
    std = torch.where(n > 1, squares / (n - 1).clamp(min=1), 0.0).sqrt()[inverse]
    return n[inverse], mean, std


@_register("grpo")
def _grpo(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float, token_counts: Any = None) -> torch.Tensor:
    """``(r - mean_g) / (std_g + eps)`` (verl ``compute_grpo_outcome_advantage``, TRL ``scale_rewards="group"``)."""
    size, mean, std = _group_stats(rewards, groups)
    return torch.where(size > 1, (rewards - mean) / (std + eps), 0.0)


@_register("grpo_no_std", "dr_grpo")
def _grpo_no_std(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float, token_counts: Any = None) -> torch.Tensor:
    """``r - mean_g`` (verl ``norm_adv_by_std_in_grpo=False``, Dr.GRPO, TRL ``scale_rewards="none"``)."""
    size, mean, _ = _group_stats(rewards, groups)
    return torch.where(size > 1, rewards - mean, 0.0)


@_register("rloo")
def _rloo(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float, token_counts: Any = None) -> torch.Tensor:
    """``r - mean of the others = n / (n - 1) * (r - mean_g)`` (verl ``compute_rloo_outcome_advantage``, NeMo-RL
    leave-one-out baseline)."""
    size, mean, _ = _group_stats(rewards, groups)
    return torch.where(size > 1, (rewards - mean) * size / (size - 1).clamp(min=1), 0.0)


def _whiten(values: torch.Tensor, token_counts: torch.Tensor | None) -> torch.Tensor:
    """verl's ``masked_whiten`` of a per-sample value repeated over its tokens: the mean and the unbiased variance
    over every token (each sample weighs its token count; ``None``: 1), ``(x - mean) / sqrt(var + 1e-8)``."""
    weights = torch.ones_like(values) if token_counts is None else token_counts
    total = weights.sum()
    if total < 2:
        return torch.zeros_like(values)
    mean = (weights * values).sum() / total
    variance = (weights * (values - mean).square()).sum() / (total - 1)
    return torch.where(weights > 0, (values - mean) * torch.rsqrt(variance + 1e-8), 0.0)


@_register("reinforce_pp")
def _reinforce_pp(rewards: torch.Tensor, groups: Any, *, eps: float, token_counts: Any = None) -> torch.Tensor:
    """The reward whitened over the rollout (verl ``compute_reinforce_plus_plus_outcome_advantage``, ``gamma=1``)."""
    return _whiten(rewards, token_counts)


@_register("reinforce_pp_baseline")
def _reinforce_pp_baseline(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float, token_counts: Any = None):
    """``r - mean_g`` (0 baseline for a group of one, as verl), whitened over the rollout (verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``)."""
    size, mean, _ = _group_stats(rewards, groups)
    return _whiten(torch.where(size > 1, rewards - mean, rewards), token_counts)


_NEEDS_GROUPS = ("grpo", "grpo_no_std", "dr_grpo", "rloo", "reinforce_pp_baseline")


def advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    estimator: Literal["grpo", "grpo_no_std", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo",
    eps: float = 1e-6,
    token_counts: torch.Tensor | np.ndarray | Sequence[int] | None = None,
) -> torch.Tensor:
    """One advantage per sample from outcome rewards, in the rollout's order (float32, or float64 rewards' dtype).

    - ``"grpo"``: ``(r - mean_g) / (std_g + eps)``, the group's unbiased std;
    - ``"grpo_no_std"`` / ``"dr_grpo"`` (the same estimator): ``r - mean_g``;
    - ``"rloo"``: ``r`` minus the mean of the other samples of its group;
    - ``"reinforce_pp"``: ``r`` whitened over the rollout; ``"reinforce_pp_baseline"``: ``r - mean_g`` whitened.

    A group of one sample gets exactly 0 from the GRPO variants and RLOO (no baseline; never NaN).

    Args:
        rewards: ``[N]`` finite rewards.
        group_ids: ``[N]`` group labels (``Rollout.group_ids``); needed by every estimator but ``"reinforce_pp"``.
        estimator: a name of :data:`ADVANTAGE_ESTIMATORS`.
        eps: added to GRPO's std (verl's ``epsilon``).
        token_counts: each sample's response tokens (``Rollout.loss_tokens``): REINFORCE++ then whitens over tokens,
            as verl's ``masked_whiten`` of the repeated reward does (a sample without a token counts 0 and gets 0);
            ``None`` whitens over samples.

    Example:
        >>> advantages(torch.tensor([1.0, 0.0, 0.5, 0.7]), [0, 0, 0, 1], estimator="rloo").tolist()
        [0.75, -0.75, 0.0, 0.0]
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    values = torch.as_tensor(rewards)
    out_dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    values = values.detach().cpu().double().reshape(-1)
    if not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).nonzero()[0])
        raise ValueError(f"rewards must be finite, sample {bad} has {values[bad].item()}")
    groups = None
    if group_ids is not None:
        groups = torch.as_tensor(group_ids).detach().cpu().reshape(-1)
        if groups.numel() != values.numel():
            raise ValueError(f"group_ids has {groups.numel()} entries for {values.numel()} rewards")
    elif estimator in _NEEDS_GROUPS:
        raise ValueError(f"estimator={estimator!r} needs group_ids (the rollout's GRPO groups), got None")
    counts = None
    if token_counts is not None:
        counts = torch.as_tensor(np.asarray(token_counts)).detach().cpu().double().reshape(-1)
        if counts.numel() != values.numel() or bool((counts < 0).any()):
            raise ValueError(f"token_counts must be {values.numel()} counts >= 0, got {counts.tolist()[:8]}")
    fn = ADVANTAGE_ESTIMATORS[estimator]
    return fn(values, groups, eps=float(eps), token_counts=counts).to(out_dtype)


def spread_over_tokens(values: torch.Tensor | Sequence[float], rollout: Rollout) -> list[torch.Tensor]:
    """Each sample's value on each of its loss-mask tokens (0 elsewhere): the per-token field the losses read.

    Example:
        >>> rollout = Rollout(input_ids=[[5, 6, 7], [8, 9]], loss_mask=[[0, 1, 1], [0, 1]])
        >>> [v.tolist() for v in spread_over_tokens(torch.tensor([0.5, -1.0]), rollout)]
        [[0.0, 0.5, 0.5], [0.0, -1.0]]
    """
    per_sample = torch.as_tensor(values).detach().cpu().reshape(-1)
    if per_sample.numel() != len(rollout):
        raise ValueError(f"{per_sample.numel()} values for a rollout of {len(rollout)} samples")
    per_sample = per_sample.float() if per_sample.dtype != torch.float64 else per_sample
    # numpy's repeat (torch's repeat_interleave wakes every CPU thread per call) and the rollout's own flat mask
    flat = torch.from_numpy(np.repeat(per_sample.numpy(), rollout.lengths))
    flat.masked_fill_(~rollout.flat_loss_mask, 0.0)
    return list(flat.split(rollout.lengths.tolist()))


class GroupFilter(NamedTuple):
    """What :func:`filter_groups` kept and dropped."""

    rollout: Rollout | None
    """The rollout of the kept samples (fields and group ids kept), ``None`` when every group was dropped."""
    kept: torch.Tensor
    """Indices of the kept samples in the original rollout (index the rewards with it)."""
    dropped_groups: int
    dropped_samples: int


def filter_groups(rollout: Rollout, rewards: torch.Tensor | Sequence[float], *, atol: float = 0.0) -> GroupFilter:
    """DAPO's dynamic sampling: drop every group whose rewards are all equal (its GRPO advantages are all 0, so it
    only dilutes the step), counted.

    A group of one sample is dropped too (its advantage is 0). verl's ``filter_groups`` keeps groups whose metric
    has a std above 0; here ``max - min <= atol`` drops (``atol=0``: exactly equal).

    Example:
        >>> rollout = Rollout(input_ids=[[1, 2], [3, 4], [5, 6], [7, 8]], group_ids=[0, 0, 1, 1])
        >>> kept = filter_groups(rollout, torch.tensor([1.0, 1.0, 0.0, 1.0]))
        >>> kept.kept.tolist(), kept.dropped_groups, kept.dropped_samples
        ([2, 3], 1, 2)
    """
    if rollout.group_ids is None:
        raise ValueError("filter_groups needs the rollout's group_ids (its GRPO groups), got None")
    values = torch.as_tensor(rewards).detach().cpu().double().reshape(-1)
    if values.numel() != len(rollout):
        raise ValueError(f"{values.numel()} rewards for a rollout of {len(rollout)} samples")
    _, inverse = torch.unique(rollout.group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    high = torch.full((groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, values, "amax")
    low = torch.full((groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, values, "amin")
    keep_group = (high - low) > atol
    kept = keep_group[inverse].nonzero().reshape(-1)
    dropped_groups = int((~keep_group).sum())
    if kept.numel() == 0:
        return GroupFilter(None, kept, dropped_groups, len(rollout))
    index = kept.tolist()
    subset = Rollout(
        input_ids=[rollout.input_ids[i] for i in index],
        loss_mask=[rollout.loss_mask[i] for i in index],
        token_fields={name: [values_[i] for i in index] for name, values_ in rollout.token_fields.items()},
        sample_fields={name: values_[kept] for name, values_ in rollout.sample_fields.items()},
        group_ids=rollout.group_ids[kept],
    )
    return GroupFilter(subset, kept, dropped_groups, len(rollout) - len(index))


def overlong_penalty(
    lengths: torch.Tensor | np.ndarray | Sequence[int], max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each sample's reward: 0 up to ``max_length - buffer`` response
    tokens, then falling linearly to ``-factor`` at ``max_length`` (verl ``reward_manager/dapo``:
    ``min(-(length - (max_length - buffer)) / buffer * factor, 0)``).

    Example:
        >>> overlong_penalty([10, 16, 20], max_length=20, buffer=8, factor=1.0).tolist()
        [0.0, -0.5, -1.0]
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer!r}")
    if not factor >= 0:
        raise ValueError(f"factor must be >= 0, got {factor!r}")
    n = torch.as_tensor(np.asarray(lengths)).double().reshape(-1)
    exceed = n - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0).float()
