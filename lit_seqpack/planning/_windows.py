"""Input checks, the plan of one window, and the per-microbatch figures the plan needs.

A window's microbatches come back flat: ``members`` (dataset indices in microbatch order) and
``sizes`` (samples per microbatch; ``0`` is an empty lock-step filler), with ``len(sizes)`` a multiple
of ``world_size x accumulate_grad_batches``. :func:`plan_window` adds the ``(step, rank, slot)`` grid;
:func:`window_steps` counts a window's steps without planning it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lit_seqpack.planning import _kernels
from lit_seqpack.planning._sorting import decreasing_order, decreasing_runs, dense_histogram
from lit_seqpack.planning.balance import assign_slots, order_within_bundles
from lit_seqpack.planning.dynamic import dynamic_group_sizes, fixed_group_sizes, round_up, run_group_sizes

if TYPE_CHECKING:
    from lit_seqpack.planning.config import PlanConfig

__all__ = [
    "WindowPlan",
    "as_counts",
    "check_budget",
    "compact_counts",
    "microbatch_figures",
    "plan_window",
    "slot_window",
    "window_microbatches",
    "window_steps",
]


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
    array = array.astype(np.int64, copy=False)  # read-only use: an int64 input is not copied
    if array.size and int(array.min()) < 0:
        i = int(np.flatnonzero(array < 0)[0])
        raise ValueError(f"{name}[{i}] = {int(array[i])} is negative")
    return array


def compact_counts(name: str, values: object, size: int | None = None) -> np.ndarray:
    """Like :func:`as_counts`, in the smallest unsigned dtype that holds them (``uint16`` for most lengths).

    Example:
        >>> compact_counts("lengths", [3, 0, 5]).dtype.name
        'uint16'
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if size is not None and array.size != size:
        raise ValueError(f"{name} must have one entry per sample ({size}), got {array.size}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint16)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "i" and array.min() < 0:
        i = int(np.argmax(array < 0))
        raise ValueError(f"{name}[{i}] = {int(array[i])} is negative")
    top = int(array.max())
    dtype = np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.int64
    return array.astype(dtype, copy=False)


def check_budget(lengths: np.ndarray, config: PlanConfig) -> None:
    """Raise ``ValueError`` naming the first sample longer than ``max_tokens`` (packing and dynamic)."""
    if config.mode == "padded" or lengths.size == 0 or int(lengths.max()) <= config.max_tokens:
        return
    over = np.flatnonzero(lengths > config.max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"sample {i} has length {int(lengths[i])} > max_tokens={config.max_tokens} "
            f"({over.size} over-long samples in mode {config.mode!r}); drop or truncate them in the data layer"
        )


def _pack(window_lengths: np.ndarray, config: PlanConfig, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Flat packer bins (positions in the window, ends) whose count plus the returned filler count fills whole steps.

    Any-fit packers leave at most one bin half empty, so they make at most ``2 * tokens // capacity + 1``
    bins; when the next multiple of that bound still has enough samples, one call with
    ``bin_count_multiple`` is safe. Otherwise the count is checked first, and when there are fewer
    samples than slots every sample gets its own microbatch and empty fillers complete the step. Either
    way the window makes ``round_up(bins of the algorithm, slots_per_step)`` microbatches.
    """
    from lit_seqpack.planning.algorithms import get_packer, packing_algorithm

    algorithm, capacity, multiple = packing_algorithm(config.algorithm).name, config.max_tokens, config.slots_per_step
    n = int(window_lengths.size)
    bound = min(n, 2 * int(window_lengths.sum()) // capacity + 1)
    if round_up(bound, multiple) <= n:
        return *get_packer(algorithm, capacity, bin_count_multiple=multiple, seed=seed).pack_flat(window_lengths), 0
    flat, ends = get_packer(algorithm, capacity, seed=seed).pack_flat(window_lengths)
    target = round_up(ends.size, multiple)
    if target == ends.size:
        return flat, ends, 0
    real = min(target, n)
    return *get_packer(algorithm, capacity, min_bin_count=real, seed=seed).pack_flat(window_lengths), target - real


def window_microbatches(
    lengths: np.ndarray, positions: np.ndarray | None, config: PlanConfig, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Group one window of samples into microbatches.

    Args:
        lengths: lengths of the whole dataset (``int64``).
        positions: dataset indices of the window, in (shuffled) order; ``None``: ``lengths`` is the window.
        config: the plan configuration.
        seed: seed for a randomised packer (``first_fit_shuffle``).

    Returns:
        ``(members, sizes)``: dataset indices in microbatch order and samples per microbatch.
    """
    local, sizes = _local_microbatches(_window_lengths(lengths, positions), config, seed)
    return (local if positions is None else positions[local]), sizes


def _window_lengths(lengths: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    """``lengths[positions]`` (compiled: numpy converts a ``uint32`` index array first), or ``lengths``."""
    return lengths if positions is None else _kernels.get_kernel("gather")(lengths, positions)


def _local_microbatches(window_lengths: np.ndarray, config: PlanConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`window_microbatches` in positions of the window: ``(local, sizes)``."""
    multiple = config.slots_per_step
    if config.mode == "padded":
        local = np.arange(window_lengths.size)
        return local, fixed_group_sizes(local.size, config.batch_size, group_count_multiple=multiple)
    if config.mode == "dynamic":
        histogram = dense_histogram(window_lengths)
        order = decreasing_order(window_lengths, histogram)  # np.argsort(-window_lengths, kind="stable")
        knobs = {"sequence_length_round": config.sequence_length_round, "group_count_multiple": multiple}
        if histogram is None:  # huge lengths: no counting sort
            return order, dynamic_group_sizes(window_lengths[order], config.max_tokens, **knobs)
        return order, run_group_sizes(*decreasing_runs(window_lengths, histogram), config.max_tokens, **knobs)
    flat, ends, fillers = _pack(window_lengths, config, seed)
    return flat, np.concatenate([np.diff(ends, prepend=0), np.zeros(fillers, dtype=np.int64)])


def window_seeds(config: PlanConfig, epoch: int, w: int) -> np.random.SeedSequence:
    """The seeds of window ``w``: the packer's seed and the balancing rng."""
    # SeedSequence pads entropy with zeros, so [s, e] and [s, e, 0] collide: each stream ends in its own tag
    return np.random.SeedSequence([config.seed, epoch, w, 2] if config.shuffle else [config.seed, w, 3])


def window_steps(window_lengths: np.ndarray, config: PlanConfig, seed: int) -> int:
    """Optimizer steps window ``w`` will have (``window_lengths`` of any integer dtype), without planning it.

    Example:
        >>> from lit_seqpack.planning.config import PlanConfig
        >>> window_steps(np.array([5, 3, 4, 4, 2]), PlanConfig(max_tokens=8, world_size=2), seed=0)
        2
    """
    multiple, n = config.slots_per_step, int(window_lengths.size)
    if config.mode == "padded":
        return int(fixed_group_sizes(n, config.batch_size, group_count_multiple=multiple).size) // multiple
    if config.mode == "dynamic":
        sizes = dynamic_group_sizes(
            np.sort(window_lengths)[::-1].astype(np.int64),
            config.max_tokens,
            sequence_length_round=config.sequence_length_round,
            group_count_multiple=multiple,
        )
        return int(sizes.size) // multiple
    from lit_seqpack.planning.algorithms import get_packer, packing_algorithm

    packer = get_packer(packing_algorithm(config.algorithm).name, config.max_tokens, seed=seed)
    return round_up(packer.count_bins(window_lengths), multiple) // multiple


class WindowPlan(NamedTuple):
    """One window's plan: microbatch ``m`` is ``members[bounds[m]:bounds[m + 1]]``; ``grid[s, r, j]`` is a
    microbatch id (local to the window); ``figures`` are :func:`microbatch_figures` of the microbatches."""

    members: np.ndarray
    sizes: np.ndarray
    grid: np.ndarray
    figures: dict[str, np.ndarray]


def plan_window(
    lengths: np.ndarray,
    loss_tokens: np.ndarray | None,
    positions: np.ndarray | None,
    config: PlanConfig,
    epoch: int,
    w: int,
) -> WindowPlan:
    """Plan window ``w`` of ``epoch``: microbatches, then their ``[steps, world_size, accumulate]`` grid.

    Args:
        lengths: lengths of the whole dataset (any integer dtype), or of the window alone with ``positions=None``
            (members are then positions in the window).
        loss_tokens: loss tokens, indexed like ``lengths``; ``None``: ``max(length - 1, 0)``.
        positions: indices into ``lengths`` of the window's samples, in order, or ``None``.
        config: the plan configuration.
        epoch: the epoch.
        w: the window's number in the epoch (seeds its packer and its balancing).
    """
    seeds = window_seeds(config, epoch, w)
    window_lengths = _window_lengths(lengths, positions)
    local, sizes = _local_microbatches(window_lengths, config, int(seeds.generate_state(1)[0]))
    return slot_window(window_lengths, loss_tokens, positions, local, sizes, config, seeds)


def slot_window(
    window_lengths: np.ndarray,
    loss_tokens: np.ndarray | None,
    positions: np.ndarray | None,
    local: np.ndarray,
    sizes: np.ndarray,
    config: PlanConfig,
    seeds: np.random.SeedSequence,
) -> WindowPlan:
    """A window's microbatches on the ``(step, rank, slot)`` grid, balanced as :func:`plan_window` balances them.

    Args:
        window_lengths: lengths of the window's samples (or of the whole dataset, with ``positions``).
        loss_tokens: loss tokens, indexed like ``window_lengths``; ``None``: ``max(length - 1, 0)``.
        positions: dataset indices of the window's samples, or ``None`` (members are positions in the window).
        local: positions in the window, microbatch by microbatch.
        sizes: samples per microbatch (``0``: an empty lock-step filler), a whole number of steps.
        config: the plan configuration.
        seeds: the window's seeds (:func:`window_seeds`): the balancing rng of a shuffled plan.
    """
    members, figures = _figures(window_lengths, loss_tokens, positions, local, sizes, config)
    rng = np.random.default_rng(seeds) if config.shuffle else None
    grid = assign_slots(figures["cost"], config.world_size, config.accumulate_grad_batches, rng)
    return WindowPlan(members, sizes, order_within_bundles(grid, figures["cost"], config.microbatch_order), figures)


def microbatch_figures(
    lengths: np.ndarray, loss_tokens: np.ndarray | None, members: np.ndarray, sizes: np.ndarray, config: PlanConfig
) -> dict[str, np.ndarray]:
    """Per-microbatch ``tokens``, ``loss_tokens``, ``computed`` (after padding) and balancing ``cost``.

    Args:
        lengths: lengths of the whole dataset.
        loss_tokens: loss tokens of each sample of the dataset; ``None``: ``max(length - 1, 0)``.
        members: dataset indices in microbatch order.
        sizes: samples per microbatch.
        config: the plan configuration (mode, rounding, cost coefficients).

    Returns:
        A dict of arrays with one value per microbatch.
    """
    return _figures(lengths, loss_tokens, None, members, sizes, config)[1]


_NONE = np.zeros(0, dtype=np.int64)  # the kernel's "not given" (an empty array: one compiled signature)


def _figures(
    window_lengths: np.ndarray,
    loss_tokens: np.ndarray | None,
    positions: np.ndarray | None,
    local: np.ndarray,
    sizes: np.ndarray,
    config: PlanConfig,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Members (``positions[local]``, or ``local``) and the :func:`microbatch_figures`, in one compiled pass."""
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    a, b, r = config.cost_linear, config.quadratic_cost, config.sequence_length_round
    kernel = _kernels.get_kernel("segment_figures")
    members, tokens, loss, doc_cost, longest = kernel(
        window_lengths,
        _NONE if loss_tokens is None else loss_tokens,
        _NONE if positions is None else positions,
        local,
        bounds,
        float(a),
        float(b),
    )
    figures = {"tokens": tokens, "loss_tokens": loss}
    if config.mode == "packing":
        figures["cost"] = doc_cost
        figures["computed"] = round_up(tokens, r)
        return members, figures
    padded = round_up(longest, r)
    figures["cost"] = sizes * (a * padded.astype(np.float64) + b * padded.astype(np.float64) ** 2)
    figures["computed"] = sizes * padded
    return members, figures
