"""The plan of one RL rollout: optimizer steps, a sample-level rank balance, then microbatches per rank.

A rollout is a few hundred to a few thousand samples that live in memory and change every iteration. Every rank
computes the same plan from the same lengths (no collective) and reads its own column::

    samples (groups)   g0 g0 g1 g1 g2 g2 g3 g3 ...
    steps              cut at group boundaries: samples_per_step, or steps_per_rollout near-equal steps
    per step           Karmarkar-Karp over ranks on the cost a*L + b*L^2 of each sample (or each group with
                       keep_together="rank" / "microbatch")
    per rank           packer bins (packing) or sorted token-budget groups (dynamic) of at most max_tokens;
                       a group is one packer item with keep_together="microbatch"
    lock step          every rank runs A microbatches in every step: bins are split to reach A where the
                       rank has enough items, then empty zero-weight fillers complete the step

Balancing samples before packing gives near-equal ranks even for windows of a few hundred samples, where dealing
whole packed microbatches over ranks is too coarse. Groups (GRPO groups, DPO pairs) are never split across
optimizer steps, so each step's group count and per-group token totals are well defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from lit_seqpack.planning._rollout_microbatches import rank_microbatches
from lit_seqpack.planning._rollout_steps import balance_step, cut_steps, group_units
from lit_seqpack.planning._windows import as_counts
from lit_seqpack.planning.dynamic import round_up
from lit_seqpack.planning.rollout_config import KEEP_TOGETHER, ROLLOUT_MODES, RolloutPlanConfig

__all__ = ["KEEP_TOGETHER", "ROLLOUT_MODES", "RolloutPlan", "RolloutPlanConfig", "dense_group_labels", "plan_rollout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutPlan:
    """The plan of one rollout, the same on every rank.

    Args:
        config: what was planned.
        microbatches: ``microbatches[step][rank][slot]``: sample indices (``[]`` is a zero-weight filler); every
            rank has ``accumulate_grad_batches`` slots in every step.
        accumulate_grad_batches: microbatches per rank per step.
        step_loss_tokens: loss tokens of each step over all ranks.
        step_documents: samples of each step.
        step_groups: groups of each step (a sample without a group is a group of its own).
        group_loss_tokens: per sample, the loss tokens of its group (its step holds the whole group).
        rank_tokens: ``[steps, world_size]`` real tokens each rank runs in each step.
        rank_cost: ``[steps, world_size]`` the balance cost of each rank in each step.
    """

    config: RolloutPlanConfig
    microbatches: list[list[list[list[int]]]]
    accumulate_grad_batches: int
    step_loss_tokens: np.ndarray
    step_documents: np.ndarray
    step_groups: np.ndarray
    group_loss_tokens: np.ndarray
    rank_tokens: np.ndarray
    rank_cost: np.ndarray

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the rollout."""
        return len(self.microbatches)

    def rank_microbatches(self, rank: int) -> list[tuple[int, int, list[int]]]:
        """``(step, slot, sample indices)`` of every microbatch of ``rank``, in training order."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be in [0, {self.config.world_size}), got {rank}")
        return [(s, j, list(mb)) for s, step in enumerate(self.microbatches) for j, mb in enumerate(step[rank])]

    def imbalance(self, what: Literal["tokens", "cost"] = "cost") -> tuple[float, float]:
        """Mean and worst over steps of max/mean over ranks of ``rank_tokens`` or ``rank_cost``."""
        loads = (self.rank_tokens if what == "tokens" else self.rank_cost).astype(np.float64)
        means = loads.mean(axis=1)
        ratios = loads.max(axis=1)[means > 0] / means[means > 0]
        return (float(ratios.mean()), float(ratios.max())) if ratios.size else (1.0, 1.0)


def plan_rollout(
    lengths: Sequence[int] | np.ndarray,
    config: RolloutPlanConfig,
    *,
    loss_tokens: Sequence[int] | np.ndarray | None = None,
    group_ids: Sequence[int] | np.ndarray | None = None,
) -> RolloutPlan:
    """Plan one rollout (see the module docstring).

    Args:
        lengths: tokens of every sample.
        config: what to plan.
        loss_tokens: tokens that carry a loss in each sample (default ``length - 1``).
        group_ids: a group label per sample (GRPO group, DPO pair); ``None``: every sample is its own group.

    Raises:
        ValueError: a sample longer than ``max_tokens``, a group longer than ``max_tokens`` under
            ``keep_together="microbatch"`` or longer than a rank's whole step (``accumulate_grad_batches``
            microbatches) under ``keep_together="rank"``, a step boundary inside a group, a rollout that is not a
            multiple of ``samples_per_step``, more steps than groups, or a step that needs more microbatches than
            ``accumulate_grad_batches``.

    Example:
        >>> plan = plan_rollout([5, 3, 4, 4, 2, 6], RolloutPlanConfig(max_tokens=8, world_size=2, steps_per_rollout=2))
        >>> plan.microbatches, plan.step_loss_tokens.tolist()
        ([[[[2, 1]], [[0]]], [[[5]], [[3, 4]]]], [9, 9])
    """
    lengths = as_counts("lengths", lengths)
    n = lengths.size
    if n == 0:
        raise ValueError("the rollout has no sample")
    loss = np.maximum(lengths - 1, 0) if loss_tokens is None else as_counts("loss_tokens", loss_tokens, n)
    groups = dense_group_labels(group_ids, n)
    _check_budget(lengths, groups, config, group_ids)
    members, bounds = group_units(groups, config)
    steps = cut_steps(bounds, config)
    costs = config.cost_linear * lengths + config.quadratic_cost * lengths.astype(np.float64) ** 2
    per_step = [balance_step(members, bounds, units, costs, config) for units in steps]
    natural = [[rank_microbatches(*share, lengths, config) for share in ranks] for ranks in per_step]
    needed = max((len(bins) for row in natural for bins in row), default=1)
    accumulate = config.accumulate_grad_batches or max(needed, 1)
    if needed > accumulate:
        if config.keep_together == "rank":
            _check_rank_groups(members, bounds, lengths, config, group_ids)
        s, r = next((s, r) for s, row in enumerate(natural) for r, bins in enumerate(row) if len(bins) == needed)
        raise ValueError(
            f"step {s} needs {needed} microbatches of max_tokens={config.max_tokens} on rank {r} but "
            f"accumulate_grad_batches={accumulate}: raise the token budget, the number of steps, or "
            "accumulate_grad_batches"
        )
    microbatches = [  # a rank already at the count keeps its bins; the others split bins, then get fillers
        [
            bins if len(bins) == accumulate else rank_microbatches(*share, lengths, config, target=accumulate)
            for share, bins in zip(ranks, row, strict=True)
        ]
        for ranks, row in zip(per_step, natural, strict=True)
    ]
    cell = np.zeros(n, dtype=np.int64)  # step * world_size + rank of every sample
    for s, ranks in enumerate(per_step):
        for r, share in enumerate(ranks):
            cell[share.samples] = s * config.world_size + r
    step_of, cells = cell // config.world_size, len(steps) * config.world_size
    group_totals = np.bincount(groups, weights=loss).astype(np.int64)
    return RolloutPlan(
        config=config,
        microbatches=microbatches,
        accumulate_grad_batches=accumulate,
        step_loss_tokens=np.bincount(step_of, weights=loss, minlength=len(steps)).astype(np.int64),
        step_documents=np.array([bounds[last] - bounds[first] for first, last in steps], dtype=np.int64),
        step_groups=np.array([last - first for first, last in steps], dtype=np.int64),
        group_loss_tokens=group_totals[groups],
        rank_tokens=np.bincount(cell, weights=lengths, minlength=cells).astype(np.int64).reshape(len(steps), -1),
        rank_cost=np.bincount(cell, weights=costs, minlength=cells).reshape(len(steps), -1),
    )


def dense_group_labels(group_ids: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Dense group labels ``0..G-1`` in order of first appearance (every sample its own group by default).

    Example:
        >>> dense_group_labels([7, 3, 7, 5], 4).tolist()
        [0, 1, 0, 2]
    """
    if group_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = np.asarray(group_ids)
    if ids.shape != (n,) or (n and ids.dtype.kind not in "iu"):
        raise ValueError(f"group_ids must be {n} integers (one per sample), got shape {ids.shape} dtype {ids.dtype}")
    _, first, dense = np.unique(ids, return_index=True, return_inverse=True)
    rank_of = np.empty(first.size, dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank_of[dense.reshape(-1)]


def _group_name(g: int, groups: np.ndarray, group_ids: Sequence[int] | np.ndarray | None) -> str:
    """``group <its id as given> (samples [...])`` for an error message."""
    members = np.flatnonzero(groups == g)
    label = g if group_ids is None else np.asarray(group_ids)[members[0]].item()
    return f"group {label} (samples {members.tolist()})"


def _check_rank_groups(
    members: np.ndarray,
    bounds: np.ndarray,
    lengths: np.ndarray,
    config: RolloutPlanConfig,
    group_ids: Sequence[int] | np.ndarray | None,
) -> None:
    """Raise naming the first group that alone needs more microbatches than a rank runs in a step."""
    accumulate = config.accumulate_grad_batches
    for first, last in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        unit = members[first:last]
        needed = len(rank_microbatches(unit, np.ones(unit.size, dtype=np.int64), lengths, config))
        if needed > accumulate:
            groups = dense_group_labels(group_ids, lengths.size)
            raise ValueError(
                f"keep_together='rank': {_group_name(int(groups[unit[0]]), groups, group_ids)} has "
                f"{int(lengths[unit].sum())} tokens and needs {needed} microbatches of max_tokens={config.max_tokens}, "
                f"more than one rank's whole step (accumulate_grad_batches={accumulate}); raise max_tokens or "
                "accumulate_grad_batches, or use keep_together=None"
            )


def _check_budget(
    lengths: np.ndarray, groups: np.ndarray, config: RolloutPlanConfig, group_ids: Sequence[int] | np.ndarray | None
) -> None:
    rows = round_up(lengths, config.sequence_length_round) if config.mode == "dynamic" else lengths
    over = np.flatnonzero(rows > config.max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens > max_tokens={config.max_tokens} ({over.size} such samples): "
            "raise the budget or truncate the rollout"
        )
    if config.keep_together == "microbatch":
        if config.mode == "dynamic":  # a block of the whole group: rows x its longest padded row
            widest = np.zeros(int(groups.max()) + 1, dtype=np.int64)
            np.maximum.at(widest, groups, rows)
            group_cost = np.bincount(groups) * widest
        else:
            group_cost = np.bincount(groups, weights=lengths)
        over = np.flatnonzero(group_cost > config.max_tokens)
        if over.size:
            g = int(over[0])
            raise ValueError(
                f"keep_together='microbatch': {_group_name(g, groups, group_ids)} needs {int(group_cost[g])} tokens "
                f"> max_tokens={config.max_tokens} (one microbatch); raise the budget or use keep_together='rank'"
            )
