"""Constructor checks of the DataModule's knobs that no config object of their own validates.

The planner knobs are validated by :class:`~lit_seqpack.planning.PlanConfig` and the parallel sizes by
:class:`~lit_seqpack.data.context_parallel.ParallelLayout`; these are the rest, and how they combine.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_seqpack.data.context_parallel import ParallelLayout

__all__ = ["check_knobs", "check_parallel_knobs"]


def check_knobs(
    *,
    mode: str,
    modes: Collection[str],
    val_fraction: float,
    test_fraction: float,
    num_workers: int,
    pad_to_multiple_of: int,
) -> None:
    """Check the mode, the held-out fractions, ``num_workers`` and ``pad_to_multiple_of`` (packing only).

    Args:
        mode: the batching mode.
        modes: the modes there are.
        val_fraction: share of the samples held out for validation.
        test_fraction: share of the samples held out for testing.
        num_workers: DataLoader worker processes.
        pad_to_multiple_of: per-document pad multiple of a packed row.

    Raises:
        ValueError: naming the first bad knob and its value.
    """
    if mode not in modes:
        raise ValueError(f"mode={mode!r} must be one of {tuple(modes)}")
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name}={fraction!r} must be in [0, 1)")
    for name, value in (("num_workers", num_workers), ("pad_to_multiple_of", pad_to_multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_workers" else 1):
            raise ValueError(f"{name}={value!r} must be an int >= {0 if name == 'num_workers' else 1}")
    if pad_to_multiple_of > 1 and mode != "packing":
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of} pads the documents of a packed row and needs mode='packing', "
            f"got mode={mode!r} (sequence_length_round pads the rows of dynamic and padded batches)"
        )


def check_parallel_knobs(layout: ParallelLayout, mode: str, max_tokens: int | None, row_multiple: int) -> None:
    """Context parallelism splits packed rows (packing only); both need a budget their row multiple divides."""
    if layout.model_parallel_size == 1:
        return
    if mode != "packing" and layout.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={layout.context_parallel_size} needs mode='packing', got mode={mode!r} "
            f"(tensor_parallel_size={layout.tensor_parallel_size} alone works in every mode)"
        )
    if isinstance(max_tokens, int) and max_tokens % row_multiple:
        raise ValueError(
            f"max_tokens={max_tokens} must be a multiple of {row_multiple}, the row multiple that "
            f"sequence_length_round, pad_to_multiple_of, context_parallel_size and tensor_parallel_size give"
        )
