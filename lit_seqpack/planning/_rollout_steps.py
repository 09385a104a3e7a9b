"""A rollout's samples cut into optimizer steps, then each step's samples dealt over data-parallel ranks.

Steps are cut at group boundaries (``samples_per_step``, or ``steps_per_rollout`` near-equal steps); in each step
the items (single samples, or whole groups under ``keep_together``) go to ranks by Karmarkar-Karp on their cost
``a*L + b*L^2``. :mod:`lit_seqpack.planning._rollout_microbatches` then turns each rank's share into microbatches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lit_seqpack.planning._partition import karmarkar_karp

if TYPE_CHECKING:
    from lit_seqpack.planning.rollout_config import RolloutPlanConfig

__all__ = ["balance_step", "cut_steps", "group_units"]


def group_units(groups: np.ndarray, config: RolloutPlanConfig) -> list[list[int]]:
    """Groups as lists of sample indices, in order of first appearance (shuffled with ``config.shuffle``)."""
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    units = [part.tolist() for part in np.split(order, bounds)] if groups.size else []
    if config.shuffle:
        units = [units[i] for i in np.random.default_rng(config.seed).permutation(len(units))]
    return units


def cut_steps(units: list[list[int]], n: int, config: RolloutPlanConfig) -> list[list[list[int]]]:
    """Consecutive units per optimizer step, cut at group boundaries."""
    ends = np.cumsum([len(u) for u in units])
    if config.samples_per_step is not None:
        per = config.samples_per_step
        if n % per:
            raise ValueError(
                f"the rollout has {n} samples, not a multiple of samples_per_step={per}: the last step would be "
                "shorter; use steps_per_rollout for near-equal steps"
            )
        targets = np.arange(per, n + 1, per)
        cuts = np.searchsorted(ends, targets)
        if not np.array_equal(ends[np.minimum(cuts, ends.size - 1)], targets):
            raise ValueError(f"samples_per_step={per} cuts a group in two; make it a multiple of the group size")
    else:
        k = config.steps_per_rollout or 1
        if k > len(units):
            raise ValueError(f"steps_per_rollout={k} is more than the rollout's {len(units)} groups (samples)")
        cuts, previous = [], -1
        for j in range(1, k):  # the unit boundary nearest to j/k of the samples, keeping every step non-empty
            nearest = int(np.argmin(np.abs(ends - j * n / k)))
            previous = min(max(nearest, previous + 1), len(units) - 1 - (k - j))
            cuts.append(previous)
        cuts = np.array([*cuts, len(units) - 1])
    starts = np.concatenate(([0], cuts[:-1] + 1))
    return [units[a : b + 1] for a, b in zip(starts.tolist(), cuts.tolist(), strict=True)]


def balance_step(step: list[list[int]], costs: np.ndarray, config: RolloutPlanConfig) -> list[list[list[int]]]:
    """Per rank, the packing items of one step: whole groups when kept together, single samples otherwise."""
    items = step if config.keep_together is not None else [[i] for unit in step for i in unit]
    parts = karmarkar_karp([costs[item].sum() for item in items], config.world_size)
    return [[items[j] for j in part] for part in parts]
