"""Constructor checks of the DataModule's settings that no config object of their own validates.

The planner settings are validated by :class:`~lit_seqpack.planning.PlanConfig` and the parallel sizes by
:class:`~lit_seqpack.data.context_parallel.ParallelLayout`; these are the rest, and how they combine.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from lit_seqpack._checks import check_choice, check_flag, check_int

if TYPE_CHECKING:
    from lit_seqpack.data.context_parallel import ParallelLayout

__all__ = ["check_batching_settings", "check_parallel_settings", "check_setting_types"]


def check_setting_types(
    *,
    source: object,
    sources: Collection[str],
    overlong: object,
    policies: Collection[str],
    shuffle: object,
    pad_token_id: object,
    strings: dict[str, object],
    fractions: dict[str, object],
) -> None:
    """Strict types of the DataModule settings that no config object of their own checks.

    Args:
        source: the data source name.
        sources: the source names there are.
        overlong: the over-long policy.
        policies: the policies there are.
        shuffle: reshuffle every epoch (a real bool).
        pad_token_id: the padding id (an int >= 0).
        strings: settings that must be a ``str`` (or ``None`` where optional), by name; a name ending in ``?``
            may be ``None``.
        fractions: settings that must be a real number, by name.

    Raises:
        ValueError: an unknown enum value or a negative pad id, naming the setting and the value.
        TypeError: a value of the wrong type, naming the setting and the value.
    """
    for name, value, choices in (("source", source, sources), ("overlong", overlong, policies)):
        check_choice(name, value, choices)
    check_flag("shuffle", shuffle)
    check_int("pad_token_id", pad_token_id, minimum=0)
    for key, value in strings.items():
        name, optional = key.rstrip("?"), key.endswith("?")
        if not (isinstance(value, str) or (optional and value is None)):
            raise TypeError(f"{name}={value!r} must be a str{' or None' if optional else ''}")
    for name, value in fractions.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}={value!r} must be a number")


def check_batching_settings(
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
        ValueError: naming the first bad setting and its value.
    """
    check_choice("mode", mode, modes)
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name}={fraction!r} must be in [0, 1)")
    check_int("num_workers", num_workers, minimum=0)
    check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
    if pad_to_multiple_of > 1 and mode != "packing":
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of} pads the documents of a packed row and needs mode='packing', "
            f"got mode={mode!r} (sequence_length_round pads the rows of dynamic and padded batches)"
        )


def check_parallel_settings(layout: ParallelLayout, mode: str, max_tokens: int | None, row_multiple: int) -> None:
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
