"""The metrics' formulas as pure functions of accumulated numbers (Python ints and floats, no torch).

The :mod:`torchmetrics` classes and the :class:`~lit_seqpack.PackingMonitor` both call these on states
that are already summed over batches and reduced over ranks, so one formula serves a single batch, a
logging window and a whole run. The packing formulas are NeMo-RL's, taken from
:mod:`lit_seqpack.planning.stats` so that the plan's statistics and the trained batches' statistics agree;
a "bin" here is a trained microbatch whose capacity is the plan's ``max_tokens`` (or its computed tokens
when the budget is unknown). Edge cases follow ``stats``: nothing to measure counts as perfect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lit_seqpack.planning import stats

__all__ = [
    "bin_balance_from_moments",
    "packing_summary",
    "padding_ratio",
    "rank_imbalance_per_step",
    "tokens_per_second",
]


def padding_ratio(padding_tokens: float, computed_tokens: float) -> float:
    """Share of the computed tokens that were padding: ``padding / computed`` (0.0 when nothing was computed).

    Example:
        >>> padding_ratio(16, 56)
        0.2857142857142857
    """
    return float(padding_tokens) / float(computed_tokens) if computed_tokens > 0 else 0.0


def tokens_per_second(tokens: float, elapsed: float) -> float:
    """``tokens / elapsed`` (0.0 before any time was measured).

    Over several ranks pass the tokens summed over ranks and the largest elapsed time: the ranks run in
    parallel and the slowest one sets the pace (not rank 0's rate times the world size).

    Example:
        >>> tokens_per_second(1000 + 3000, max(2.0, 4.0))
        1000.0
    """
    return float(tokens) / float(elapsed) if elapsed > 0 else 0.0


def bin_balance_from_moments(num_bins: int, fill_sum: int, fill_sq_sum: int) -> float:
    """``1 - pstdev(fills) / mean(fills)`` from the count, sum and sum of squares of the bin fills.

    Equals :func:`lit_seqpack.planning.stats.bin_balance` on the fills themselves, without keeping them:
    the integer moments are exact, so ``n * sum(x^2) - sum(x)^2`` (``n^2`` times the variance) is too.
    1.0 without bins or when every bin is empty.

    Example:
        >>> bin_balance_from_moments(2, 3000 + 1000, 3000**2 + 1000**2)
        0.5
    """
    if num_bins <= 0 or fill_sum <= 0:
        return 1.0
    n_squared_variance = max(int(num_bins) * int(fill_sq_sum) - int(fill_sum) ** 2, 0)
    # pstdev / mean = sqrt(n^2 var) / n / (sum / n) = sqrt(n^2 var) / sum
    return 1.0 - math.sqrt(n_squared_variance) / float(fill_sum)


def packing_summary(
    *, num_bins: int, fill_sum: int, fill_sq_sum: int, capacity_sum: int, max_capacity: int
) -> dict[str, float]:
    """NeMo-RL's packing statistics of trained microbatches ("bins").

    ``bin_utilization = sum(fill) / sum(capacity)`` (``num_bins x capacity`` when every bin has the
    same capacity), ``waste_ratio = 1 - bin_utilization``, ``bin_balance = 1 - pstdev(fill) / mean(fill)``,
    ``packing_efficiency = ceil(sum(fill) / capacity) / num_bins`` with the largest capacity seen.

    Args:
        num_bins: microbatches trained (empty dummies included: they are bins holding nothing).
        fill_sum: real tokens in them.
        fill_sq_sum: sum over the bins of the squared real tokens.
        capacity_sum: sum of their capacities.
        max_capacity: the largest capacity.

    Example:
        >>> s = packing_summary(num_bins=4, fill_sum=40, fill_sq_sum=552, capacity_sum=64, max_capacity=16)
        >>> s["bin_utilization"], s["waste_ratio"], s["packing_efficiency"], round(s["bin_balance"], 4)
        (0.625, 0.375, 0.75, 0.3836)
    """
    if num_bins <= 0:
        utilization, min_bins = 1.0, 0
    else:
        # one "bin" of the summed capacity keeps the division exact when capacities differ (padded batches)
        utilization = stats.bin_utilization(fill_sum, 1, capacity_sum)
        min_bins = stats.theoretical_min_bins(fill_sum, max_capacity) if max_capacity > 0 else 0
    return {
        "packing_efficiency": stats.packing_efficiency(min_bins, num_bins),
        "bin_utilization": utilization,
        "waste_ratio": 1.0 - utilization,
        "bin_balance": bin_balance_from_moments(num_bins, fill_sum, fill_sq_sum),
    }


def rank_imbalance_per_step(tokens: Sequence[Sequence[float]]) -> list[float]:
    """``max over ranks / mean over ranks`` of the tokens of each optimizer step.

    Args:
        tokens: ``tokens[rank][step]``, every rank with the same number of steps.

    Returns:
        One value per step, >= 1.0; a step in which no rank had a token counts as balanced (1.0).

    Raises:
        ValueError: the ranks have different numbers of steps.

    Example:
        >>> rank_imbalance_per_step([[100, 300], [300, 300]])
        [1.5, 1.0]
    """
    if not tokens:
        return []
    steps = {len(row) for row in tokens}
    if len(steps) != 1:
        raise ValueError(f"every rank must have the same number of optimizer steps, got {sorted(steps)}")
    result = []
    for column in zip(*tokens, strict=True):
        total = float(sum(column))
        result.append(max(column) * len(column) / total if total > 0 else 1.0)
    return result
