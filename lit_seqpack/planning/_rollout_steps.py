"""A rollout's samples cut into optimizer steps, then each step's samples dealt over data-parallel ranks.

Groups are held as flat arrays (``members[bounds[u]:bounds[u + 1]]`` are the samples of unit ``u``), never as a
Python list per group. Steps are cut at group boundaries (``samples_per_step``, or ``steps_per_rollout``
near-equal steps); in each step the items (single samples, or whole groups under ``keep_together``) go to ranks by
Karmarkar-Karp on their cost ``a*L + b*L^2``. :mod:`lit_seqpack.planning._rollout_microbatches` then turns each
rank's share into microbatches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lit_seqpack.planning._partition import karmarkar_karp_parts

if TYPE_CHECKING:
    from lit_seqpack.planning.rollout_config import RolloutPlanConfig

__all__ = ["Share", "balance_step", "cut_steps", "group_units"]


class Share(NamedTuple):
    """One rank's part of a step: its samples, item after item, and each item's sample count."""

    samples: np.ndarray
    item_sizes: np.ndarray


def group_units(groups: np.ndarray, config: RolloutPlanConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(members, bounds)``: groups in order of first appearance (shuffled with ``config.shuffle``), unit ``u``
    being ``members[bounds[u]:bounds[u + 1]]``.

    Example:
        >>> from lit_seqpack.planning.rollout_config import RolloutPlanConfig
        >>> members, bounds = group_units(np.array([0, 1, 0, 2]), RolloutPlanConfig(max_tokens=8))
        >>> members.tolist(), bounds.tolist()
        ([0, 2, 1, 3], [0, 2, 3, 4])
    """
    members = np.argsort(groups, kind="stable")
    sizes = np.bincount(groups) if groups.size else np.zeros(0, dtype=np.int64)
    if config.shuffle:
        perm = np.random.default_rng(config.seed).permutation(sizes.size)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))[perm]
        sizes = sizes[perm]
        new_starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        members = members[np.repeat(starts - new_starts, sizes) + np.arange(members.size)]
    return members, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def cut_steps(bounds: np.ndarray, config: RolloutPlanConfig) -> list[tuple[int, int]]:
    """Each optimizer step's units ``[first, last)``, cut at group boundaries."""
    ends, n, units = bounds[1:], int(bounds[-1]), bounds.size - 1
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
        if k > units:
            raise ValueError(f"steps_per_rollout={k} is more than the rollout's {units} groups (samples)")
        cuts, previous = [], -1
        for j in range(1, k):  # the unit boundary nearest to j/k of the samples, keeping every step non-empty
            nearest = int(np.argmin(np.abs(ends - j * n / k)))
            previous = min(max(nearest, previous + 1), units - 1 - (k - j))
            cuts.append(previous)
        cuts = np.array([*cuts, units - 1])
    starts = np.concatenate(([0], cuts[:-1] + 1))
    return list(zip(starts.tolist(), (cuts + 1).tolist(), strict=True))


def balance_step(
    members: np.ndarray, bounds: np.ndarray, units: tuple[int, int], costs: np.ndarray, config: RolloutPlanConfig
) -> list[Share]:
    """Per rank, its items of one step (whole groups when kept together, single samples otherwise), in step order."""
    first, last = units
    samples = members[bounds[first] : bounds[last]]
    kept = config.keep_together is not None
    sizes = np.diff(bounds[first : last + 1]) if kept else np.ones(samples.size, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    part = karmarkar_karp_parts(np.add.reduceat(costs[samples], starts), config.world_size)
    by_rank = np.argsort(np.repeat(part, sizes), kind="stable")  # samples of rank 0, then 1, ... in step order
    sample_cuts = np.cumsum(np.bincount(part, weights=sizes, minlength=config.world_size)).astype(np.int64)[:-1]
    item_cuts = np.cumsum(np.bincount(part, minlength=config.world_size))[:-1]
    item_sizes = sizes[np.argsort(part, kind="stable")]
    return [
        Share(s, z)
        for s, z in zip(np.split(samples[by_rank], sample_cuts), np.split(item_sizes, item_cuts), strict=True)
    ]
