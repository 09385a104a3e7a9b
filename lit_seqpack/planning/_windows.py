"""Input checks, the microbatches of one planning window, and the per-microbatch figures the plan needs.

A window's microbatches come back flat: ``members`` (dataset indices in microbatch order) and
``sizes`` (samples per microbatch; ``0`` is an empty lock-step filler), with ``len(sizes)`` a multiple
of ``world_size x accumulate_grad_batches``.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from lit_seqpack.planning.dynamic import dynamic_group_sizes, fixed_group_sizes, round_up

if TYPE_CHECKING:
    from lit_seqpack.planning.plan import PlanConfig

__all__ = ["as_counts", "check_budget", "microbatch_figures", "window_microbatches"]

DEFAULT_ALGORITHM = "first_fit_decreasing"


def as_counts(name: str, values: object, size: int | None = None) -> np.ndarray:
    """``values`` as a 1-D ``int64`` array of non-negative integers (``ValueError`` names the first bad one).

    Example:
        >>> as_counts("lengths", [3, 0, 5]).tolist()
        [3, 0, 5]
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if size is not None and array.size != size:
        raise ValueError(f"{name} must have one entry per sample ({size}), got {array.size}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64)
    negative = np.flatnonzero(array < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"{name}[{i}] = {int(array[i])} is negative")
    return array


def check_budget(lengths: np.ndarray, config: PlanConfig) -> None:
    """Raise ``ValueError`` naming the first sample longer than ``max_tokens`` (packing and dynamic)."""
    if config.mode == "padded" or lengths.size == 0:
        return
    over = np.flatnonzero(lengths > config.max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"sample {i} has length {int(lengths[i])} > max_tokens={config.max_tokens} "
            f"({over.size} over-long samples in mode {config.mode!r}); drop or truncate them in the data layer"
        )


def _pack(window_lengths: np.ndarray, config: PlanConfig, seed: int) -> tuple[list[list[int]], int]:
    """Packer bins (positions in the window) whose count plus the returned filler count fills whole steps.

    Any-fit packers leave at most one bin half empty, so they make at most ``2 * tokens // capacity + 1``
    bins; when the next multiple of that bound still has enough samples, one call with
    ``bin_count_multiple`` is safe. Otherwise the count is checked first, and when there are fewer
    samples than slots every sample gets its own microbatch and empty fillers complete the step.
    """
    from lit_seqpack.planning.algorithms import get_packer

    algorithm, capacity, multiple = config.algorithm or DEFAULT_ALGORITHM, config.max_tokens, config.slots_per_step
    n = int(window_lengths.size)
    bound = min(n, 2 * int(window_lengths.sum()) // capacity + 1)
    if round_up(bound, multiple) <= n:
        return get_packer(algorithm, capacity, bin_count_multiple=multiple, seed=seed).pack(window_lengths), 0
    bins = get_packer(algorithm, capacity, seed=seed).pack(window_lengths)
    target = round_up(len(bins), multiple)
    if target == len(bins):
        return bins, 0
    real = min(target, n)
    return get_packer(algorithm, capacity, min_bin_count=real, seed=seed).pack(window_lengths), target - real


def window_microbatches(
    lengths: np.ndarray, positions: np.ndarray, config: PlanConfig, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Group one window of samples into microbatches.

    Args:
        lengths: lengths of the whole dataset.
        positions: dataset indices of the window, in (shuffled) order.
        config: the plan configuration.
        seed: seed for a randomised packer (``first_fit_shuffle``).

    Returns:
        ``(members, sizes)``: dataset indices in microbatch order and samples per microbatch.
    """
    window_lengths = lengths[positions]
    multiple = config.slots_per_step
    if config.mode == "padded":
        return positions, fixed_group_sizes(positions.size, config.batch_size, group_count_multiple=multiple)
    if config.mode == "dynamic":
        order = np.argsort(-window_lengths, kind="stable")
        sizes = dynamic_group_sizes(
            window_lengths[order],
            config.max_tokens,
            sequence_length_round=config.sequence_length_round,
            group_count_multiple=multiple,
        )
        return positions[order], sizes
    bins, fillers = _pack(window_lengths, config, seed)
    local = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=positions.size)
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    return positions[local], np.concatenate([sizes, np.zeros(fillers, dtype=np.int64)])


def _segment_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    cumulative = np.concatenate(([0], np.cumsum(values)))
    return cumulative[bounds[1:]] - cumulative[bounds[:-1]]


def microbatch_figures(
    lengths: np.ndarray, loss_tokens: np.ndarray, members: np.ndarray, sizes: np.ndarray, config: PlanConfig
) -> dict[str, np.ndarray]:
    """Per-microbatch ``tokens``, ``loss_tokens``, ``computed`` (after padding) and balancing ``cost``.

    Args:
        lengths: lengths of the whole dataset.
        loss_tokens: loss tokens of each sample of the dataset.
        members: dataset indices in microbatch order.
        sizes: samples per microbatch.
        config: the plan configuration (mode, rounding, cost coefficients).

    Returns:
        A dict of arrays with one value per microbatch.
    """
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    member_lengths = lengths[members]
    a, b, r = config.cost_linear, config.quadratic_cost, config.sequence_length_round
    tokens = _segment_sums(member_lengths, bounds)
    figures = {"tokens": tokens, "loss_tokens": _segment_sums(loss_tokens[members], bounds)}
    if config.mode == "packing":
        doc_cost = a * member_lengths.astype(np.float64) + b * member_lengths.astype(np.float64) ** 2
        figures["cost"] = _segment_sums(doc_cost, bounds)
        figures["computed"] = round_up(tokens, r)
        return figures
    longest = np.zeros(sizes.size, dtype=np.int64)
    filled = sizes > 0
    if filled.any():
        longest[filled] = np.maximum.reduceat(member_lengths, bounds[:-1][filled])
    padded = round_up(longest, r)
    figures["cost"] = sizes * (a * padded.astype(np.float64) + b * padded.astype(np.float64) ** 2)
    figures["computed"] = sizes * padded
    return figures
