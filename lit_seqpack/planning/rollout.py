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

What to plan for one RL rollout: :class:`RolloutPlanConfig` (its own module, so the rollout planner's helper
modules can name it without an import circle).

A rollout's samples cut into optimizer steps, then each step's samples dealt over data-parallel ranks.

Groups are held as flat arrays (``members[bounds[u]:bounds[u + 1]]`` are the samples of unit ``u``), never as a
Python list per group. Steps are cut at group boundaries (``samples_per_step``, or ``steps_per_rollout``
near-equal steps); in each step the items (single samples, or whole groups under ``keep_together``) go to ranks by
Karmarkar-Karp on their cost ``a*L + b*L^2``. :mod:`lit_seqpack.planning.rollout` then turns each
rank's share into microbatches.

One rank's share of a rollout step as microbatches: packer bins or sorted token-budget blocks, lock-step count.

A share is the rank's samples, item after item (one sample, or a whole group under ``keep_together``). Under
``keep_together="microbatch"`` packing hands every group to the packers of :mod:`lit_seqpack.planning.algorithms` as
one length (so it lands in one bin) and dynamic mode fills blocks with whole groups; otherwise (``None``, or
``"rank"``, whose groups were already dealt whole to this rank) the samples are packed one by one, so a group may
span several microbatches of its rank. The packers reach the target count with their ``min_bin_count`` split;
dynamic mode sorts samples longest first and cuts :func:`~lit_seqpack.planning.dynamic.dynamic_group_sizes`
blocks. Empty lists complete the count (zero-weight lock-step fillers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from lit_seqpack._checks import check_choice, check_flag, check_int, check_optional_int
from lit_seqpack.planning._windows import as_counts
from lit_seqpack.planning.balance import karmarkar_karp_parts
from lit_seqpack.planning.dynamic import dynamic_group_sizes, round_up

__all__ = [
    "KEEP_TOGETHER",
    "ROLLOUT_MODES",
    "RolloutPlan",
    "RolloutPlanConfig",
    "dense_group_labels",
    "plan_rollout",
    "Share",
    "balance_step",
    "cut_steps",
    "group_units",
    "rank_microbatches",
]


ROLLOUT_MODES: tuple[str, ...] = ("packing", "dynamic")
KEEP_TOGETHER: tuple[str | None, ...] = (None, "microbatch", "rank")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutPlanConfig:
    """What to plan for one rollout.

    Args:
        max_tokens: the token budget of a microbatch (packing: tokens of the row; dynamic: ``rows x padded length``).
        mode: ``"packing"`` or ``"dynamic"``.
        algorithm: the packer, a name in :data:`~lit_seqpack.planning.algorithms.ALGORITHMS` (packing only;
            ``None``: :data:`~lit_seqpack.planning.algorithms.DEFAULT_ALGORITHM`).
        world_size: data-parallel ranks.
        samples_per_step: samples of one optimizer step over all ranks; the rollout size must be a multiple.
        steps_per_rollout: instead, the exact number of optimizer steps (near-equal sample counts).
        accumulate_grad_batches: microbatches per rank per step, fixed (what a Lightning Trainer with automatic
            optimization needs); ``None`` uses as many as the fullest rank of any step needs.
        keep_together: ``None``, ``"microbatch"`` (a group is never split across microbatches; a group longer than
            ``max_tokens`` is refused) or ``"rank"`` (whole groups are dealt to ranks, then their samples are packed
            one by one, so a group may span several microbatches of its rank; a group longer than a rank's whole
            step is refused); groups are never split across steps either way.
        sequence_length_round: dynamic mode pads a block's length to a multiple of this.
        cost_linear: ``a`` of the cost ``a*L + b*L^2`` ranks are balanced on.
        cost_quadratic: ``b``; ``"auto"`` is ``cost_linear / max_tokens``.
        shuffle: shuffle the order of samples (of groups) before cutting steps, with ``seed``.
        seed: the shuffle's seed.
    """

    max_tokens: int
    mode: str = "packing"
    algorithm: str | None = None
    world_size: int = 1
    samples_per_step: int | None = None
    steps_per_rollout: int | None = None
    accumulate_grad_batches: int | None = None
    keep_together: Literal["microbatch", "rank"] | None = None
    sequence_length_round: int = 1
    cost_linear: float = 1.0
    cost_quadratic: float | Literal["auto"] = "auto"
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ROLLOUT_MODES)
        check_choice("keep_together", self.keep_together, KEEP_TOGETHER)
        for name, minimum in (("max_tokens", 1), ("world_size", 1), ("sequence_length_round", 1), ("seed", 0)):
            check_int(name, getattr(self, name), minimum=minimum)
        for name in ("samples_per_step", "steps_per_rollout", "accumulate_grad_batches"):
            check_optional_int(name, getattr(self, name), minimum=1)
        if self.samples_per_step is not None and self.steps_per_rollout is not None:
            raise ValueError(
                f"give samples_per_step ({self.samples_per_step}) or steps_per_rollout ({self.steps_per_rollout}), "
                "not both"
            )
        if self.algorithm is not None:
            from lit_seqpack.planning.algorithms import packing_algorithm

            if self.mode != "packing":
                raise ValueError(f"algorithm={self.algorithm!r} is only read in mode 'packing', not {self.mode!r}")
            packing_algorithm(self.algorithm)
        if self.max_tokens % self.sequence_length_round:
            raise ValueError(
                f"max_tokens={self.max_tokens} must be a multiple of sequence_length_round={self.sequence_length_round}"
            )
        for name in ("cost_linear", "cost_quadratic"):
            value = getattr(self, name)
            if name == "cost_quadratic" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        check_flag("shuffle", self.shuffle)

    @property
    def quadratic_cost(self) -> float:
        """``b`` of the balance cost: ``cost_quadratic``, or ``cost_linear / max_tokens`` for ``"auto"``."""
        return self.cost_linear / self.max_tokens if self.cost_quadratic == "auto" else float(self.cost_quadratic)


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


class Share(NamedTuple):
    """One rank's part of a step: its samples, item after item, and each item's sample count."""

    samples: np.ndarray
    item_sizes: np.ndarray


def group_units(groups: np.ndarray, config: RolloutPlanConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(members, bounds)``: groups in order of first appearance (shuffled with ``config.shuffle``), unit ``u``
    being ``members[bounds[u]:bounds[u + 1]]``.

    Example:
        >>> from lit_seqpack.planning.rollout import RolloutPlanConfig
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


def rank_microbatches(
    samples: np.ndarray, item_sizes: np.ndarray, lengths: np.ndarray, config: RolloutPlanConfig, target: int = 0
) -> list[list[int]]:
    """One rank's samples as ``target`` microbatches (as many as needed when 0), fillers included.

    Args:
        samples: the rank's sample indices, item after item.
        item_sizes: the sample count of each item (kept together under ``keep_together="microbatch"``).
        lengths: tokens of every sample of the rollout.
        config: the plan's settings.
        target: the microbatch count to reach (bins are split, then empty fillers added); 0: as many as needed.

    Example:
        >>> from lit_seqpack.planning.rollout import RolloutPlanConfig
        >>> config = RolloutPlanConfig(max_tokens=8)
        >>> rank_microbatches(np.array([0, 1, 2]), np.ones(3, int), np.array([5, 4, 3]), config)
        [[0, 2], [1]]
    """
    if samples.size == 0:
        return [[] for _ in range(target)]
    keep = config.keep_together == "microbatch"
    if config.mode == "packing":
        bins = _packed(samples, item_sizes if keep else None, lengths, config, target)
    elif keep:
        bins = _dynamic_units(samples, item_sizes, lengths, config)
    else:
        order = samples[np.argsort(-lengths[samples], kind="stable")]
        sizes = dynamic_group_sizes(
            lengths[order],
            config.max_tokens,
            sequence_length_round=config.sequence_length_round,
            group_count_multiple=max(target, 1),
        )
        bins = _split(order, np.cumsum(sizes[sizes > 0]))
    return bins + [[] for _ in range(max(target - len(bins), 0))]


def _split(flat: np.ndarray, ends: np.ndarray) -> list[list[int]]:
    items, stops = flat.tolist(), ends.tolist()
    return [items[a:b] for a, b in zip([0, *stops[:-1]], stops, strict=True)]


def _packed(
    samples: np.ndarray, item_sizes: np.ndarray | None, lengths: np.ndarray, config: RolloutPlanConfig, target: int
) -> list[list[int]]:
    """Packer bins of single samples, or of whole items (``item_sizes``) each packed as one length."""
    from lit_seqpack.planning.algorithms import get_packer, packing_algorithm

    if item_sizes is None:
        sizes = lengths[samples]
    else:
        starts = np.concatenate(([0], np.cumsum(item_sizes)[:-1]))
        sizes = np.add.reduceat(lengths[samples], starts)
    algorithm = packing_algorithm(config.algorithm)  # a sort-based packer fills a single bin longest first
    if target <= 1 and algorithm.sort_based and int(sizes.sum()) <= config.max_tokens:
        flat, ends = np.argsort(-sizes, kind="stable"), np.array([sizes.size])  # one bin, as the packer fills it
    else:
        packer = get_packer(algorithm.name, config.max_tokens, min_bin_count=min(target, sizes.size))
        flat, ends = packer.pack_flat(sizes)
    if item_sizes is None:
        return _split(samples[flat], ends)
    counts = item_sizes[flat]  # every packed item back to its samples, in bin order
    first = np.repeat(starts[flat] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return _split(samples[first + np.arange(first.size)], np.cumsum(counts)[ends - 1])


def _dynamic_units(
    samples: np.ndarray, item_sizes: np.ndarray, lengths: np.ndarray, config: RolloutPlanConfig
) -> list[list[int]]:
    """Dynamic blocks of whole groups: longest first, a block takes groups while ``rows x padded length`` fits."""
    rows = round_up(lengths, config.sequence_length_round)
    items = _split(samples, np.cumsum(item_sizes))
    order = sorted(range(len(items)), key=lambda j: -int(rows[items[j]].max()))
    blocks: list[list[int]] = []
    width = count = 0
    for j in order:
        top = int(rows[items[j]].max())
        if blocks and (count + len(items[j])) * max(width, top) <= config.max_tokens:
            blocks[-1].extend(items[j])
            count += len(items[j])
            width = max(width, top)
        else:
            blocks.append(list(items[j]))
            count, width = len(items[j]), top
    return blocks
