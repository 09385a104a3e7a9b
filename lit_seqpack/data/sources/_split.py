"""How a stream is cut into disjoint shares (``StreamSource.split``): the arithmetic every source shares.

A share is always a contiguous piece of what the stream reads (a byte interval of the concatenated JSONL files, an
interval of the Parquet row groups) or every ``stride``-th sample from ``offset`` (counted sources), so splitting a
share again (by DataLoader worker after the rank) cuts that piece the same way, and the shares of one split are
disjoint and cover the stream exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["check_share", "interval_share", "stride_share", "weighted_share"]


def check_share(index: int, count: int, stream: str) -> None:
    """Refuse a share that does not exist: ``count >= 1`` and ``0 <= index < count``, both ints.

    Raises:
        ValueError: naming the stream and the bad numbers.

    Example:
        >>> check_share(2, 2, "JsonlStream(a.jsonl)")
        Traceback (most recent call last):
        ...
        ValueError: JsonlStream(a.jsonl).split(index=2, count=2): index must be in [0, count) and count >= 1
    """
    ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (index, count))
    if not ints or count < 1 or not 0 <= index < count:
        raise ValueError(
            f"{stream}.split(index={index!r}, count={count!r}): index must be in [0, count) and count >= 1"
        )


def interval_share(start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of ``count`` equal pieces of the interval ``[start, end)``.

    Example:
        >>> [interval_share(0, 10, i, 3) for i in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    size = end - start
    return start + size * index // count, start + size * (index + 1) // count


def weighted_share(weights: Sequence[int], start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of the units ``[start, end)`` cut into ``count`` contiguous runs of about equal weight.

    Unit ``u`` goes to the share its first weight unit falls in (``count * weight before u // total``); with no
    weight at all the units are cut by number.

    Example:
        >>> [weighted_share([5, 1, 1, 1, 2], 0, 5, i, 2) for i in range(2)]
        [(0, 1), (1, 5)]
    """
    units = np.asarray(weights[start:end], dtype=np.int64)
    total = int(units.sum())
    if total == 0:
        first, last = interval_share(0, len(units), index, count)
        return start + first, start + last
    owner = np.concatenate(([0], np.cumsum(units)[:-1])) * count // total
    first, last = np.searchsorted(owner, index, side="left"), np.searchsorted(owner, index, side="right")
    return start + int(first), start + int(last)


def stride_share(offset: int, stride: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of ``count`` of the samples ``offset, offset + stride, ...``: a new ``(offset, stride)``.

    Example:
        >>> stride_share(1, 2, 1, 3)  # samples 1, 3, 5, 7, ... -> 3, 9, 15, ...
        (3, 6)
    """
    return offset + index * stride, stride * count
