"""How good a packing is: bin count against the lower bound, fill, waste and balance.

The formulas are small pure functions of numbers (or a 1-D array of bin fills) so the torchmetrics
``Metric`` classes can reuse them on their accumulated states; :func:`packing_stats` applies them to
one packing. Edge cases never divide by zero. A bin-less packing (no sequences) counts as perfect:
utilization 1, waste 0, efficiency 1, balance 1; so do bins whose fills are all 0 for the balance.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lit_seqpack._checks import check_int

__all__ = [
    "PackingStats",
    "bin_balance",
    "bin_fills",
    "bin_utilization",
    "packing_efficiency",
    "packing_stats",
    "theoretical_min_bins",
    "waste_ratio",
]


def theoretical_min_bins(total_tokens: int, capacity: int) -> int:
    """Lower bound on the bin count: ``ceil(total_tokens / capacity)``.

    Example:
        >>> theoretical_min_bins(8193, 4096)
        3
    """
    return -(-int(total_tokens) // int(capacity))


def bin_utilization(total_tokens: float, num_bins: float, capacity: float) -> float:
    """Share of the allocated tokens that hold data: ``total_tokens / (num_bins * capacity)``; 1.0 without bins.

    Example:
        >>> bin_utilization(6144, 2, 4096)
        0.75
    """
    allocated = float(num_bins) * float(capacity)
    return float(total_tokens) / allocated if allocated > 0 else 1.0


def waste_ratio(total_tokens: float, num_bins: float, capacity: float) -> float:
    """Share of the allocated tokens that are padding: ``1 - bin_utilization``; 0.0 without bins.

    Example:
        >>> waste_ratio(6144, 2, 4096)
        0.25
    """
    return 1.0 - bin_utilization(total_tokens, num_bins, capacity)


def packing_efficiency(min_bins: float, num_bins: float) -> float:
    """``theoretical_min_bins / num_bins`` (1.0 is optimal); 1.0 without bins.

    Example:
        >>> packing_efficiency(3, 4)
        0.75
    """
    return float(min_bins) / float(num_bins) if num_bins > 0 else 1.0


def bin_balance(fills: Sequence[float] | np.ndarray) -> float:
    """``1 - stdev(fills) / mean(fills)`` (population stdev): 1.0 when every bin holds as many tokens.

    It is 1.0 for no bins or all-empty bins, and can drop below 0 when the stdev exceeds the mean
    (a few full bins among many nearly empty ones).

    Example:
        >>> bin_balance([3000, 1000])
        0.5
    """
    values = np.asarray(fills, dtype=np.float64)
    mean = float(values.mean()) if values.size else 0.0
    return 1.0 - float(values.std()) / mean if mean > 0 else 1.0


def bin_fills(lengths: Sequence[int] | np.ndarray, bins: Sequence[Sequence[int]]) -> np.ndarray:
    """Tokens in each bin, as an ``int64`` array.

    Raises:
        ValueError: an index is out of range or appears twice.
    """
    sizes = np.asarray(lengths, dtype=np.int64)
    counts = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(itertools.chain.from_iterable(bins), dtype=np.int64, count=int(counts.sum()))
    bad = np.flatnonzero((flat < 0) | (flat >= sizes.shape[0]))
    if bad.size:
        raise ValueError(f"bins contain index {int(flat[bad[0]])}, outside [0, {sizes.shape[0]})")
    seen = np.bincount(flat, minlength=sizes.shape[0])
    if seen.size and seen.max() > 1:
        raise ValueError(f"bins contain index {int(np.argmax(seen))} more than once")
    bin_of = np.repeat(np.arange(len(bins)), counts)
    return np.bincount(bin_of, weights=sizes[flat], minlength=len(bins)).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingStats:
    """Summary of one packing (see the module functions for each formula).

    Args:
        num_bins: bins used.
        num_sequences: sequences placed in the bins.
        total_tokens: tokens in the bins.
        capacity: tokens a bin may hold.
        theoretical_min_bins: ``ceil(total_tokens / capacity)``.
        bin_utilization: ``total_tokens / (num_bins * capacity)``.
        waste_ratio: ``1 - bin_utilization``.
        bin_balance: ``1 - stdev(fill) / mean(fill)``.
        packing_efficiency: ``theoretical_min_bins / num_bins``.
        padding_tokens: ``num_bins * capacity - total_tokens``.
        min_fill: tokens in the emptiest bin (0 without bins).
        max_fill: tokens in the fullest bin (0 without bins).
        mean_fill: mean tokens per bin (0.0 without bins).
    """

    num_bins: int
    num_sequences: int
    total_tokens: int
    capacity: int
    theoretical_min_bins: int
    bin_utilization: float
    waste_ratio: float
    bin_balance: float
    packing_efficiency: float
    padding_tokens: int
    min_fill: int
    max_fill: int
    mean_fill: float

    def as_dict(self) -> dict[str, float]:
        """The fields as a plain dict (e.g. for ``log_dict``)."""
        return asdict(self)


def packing_stats(lengths: Sequence[int] | np.ndarray, bins: Sequence[Sequence[int]], capacity: int) -> PackingStats:
    """Statistics of ``bins`` (lists of indices into ``lengths``) packed at ``capacity`` tokens a bin.

    Only the sequences in ``bins`` count (stats of a subset, e.g. one rank's bins, are meaningful).

    Raises:
        ValueError: ``capacity < 1``, an index is out of range or repeated, or a bin is over capacity.

    Example:
        >>> s = packing_stats([3000, 1000, 2000], [[0, 1], [2]], 4096)
        >>> s.num_bins, s.theoretical_min_bins, s.packing_efficiency, round(s.bin_balance, 3)
        (2, 2, 1.0, 0.667)
    """
    check_int("capacity", capacity, minimum=1)
    fills = bin_fills(lengths, bins)
    over = np.flatnonzero(fills > capacity)
    if over.size:
        b = int(over[0])
        raise ValueError(f"bin {b} holds {int(fills[b])} tokens, above the capacity {capacity}")
    num_bins = len(bins)
    total = int(fills.sum())
    min_bins = theoretical_min_bins(total, capacity)
    return PackingStats(
        num_bins=num_bins,
        num_sequences=sum(len(b) for b in bins),
        total_tokens=total,
        capacity=int(capacity),
        theoretical_min_bins=min_bins,
        bin_utilization=bin_utilization(total, num_bins, capacity),
        waste_ratio=waste_ratio(total, num_bins, capacity),
        bin_balance=bin_balance(fills),
        packing_efficiency=packing_efficiency(min_bins, num_bins),
        padding_tokens=num_bins * int(capacity) - total,
        min_fill=int(fills.min()) if num_bins else 0,
        max_fill=int(fills.max()) if num_bins else 0,
        mean_fill=float(fills.mean()) if num_bins else 0.0,
    )
