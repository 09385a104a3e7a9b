"""Causal attention work per context-parallel (CP) rank: how evenly a split of packed rows loads the CP ranks.

Pure numpy (no torch). Under causal attention the query at position ``p`` of a sequence attends to ``p + 1``
keys, so a rank's work is the sum of ``p + 1`` over the positions it holds. Two splits of a packed row over
``cp`` ranks::

    zigzag      every document padded to a multiple of 2*cp, cut into 2*cp chunks;        (lit_seqpack, Megatron,
                rank r holds chunks r and 2*cp-1-r of every document                        Transformer Engine)
    contiguous  the row cut into cp consecutive pieces                                       (the naive split)

For one document of ``2 * cp * C`` tokens the zigzag pair of rank ``r`` costs ``C(rC + 1) + C(C - 1)/2 + C((2cp-1-r)C
+ 1) + C(C - 1)/2 = 2cp C^2 + C``, the same for every ``r``: the computed work is exactly balanced. Counting only
real tokens (``count="real"``), the padding at a document's end makes the rank holding the last chunk a little
lighter. The contiguous split gives the last rank of a long document about ``2cp - 1`` times the first's work.

Example:
    >>> causal_work_per_cp_rank([8], 2).tolist(), causal_work_per_cp_rank([8], 2, split="contiguous").tolist()
    ([18, 18], [10, 26])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lit_seqpack._checks import check_int

__all__ = ["CP_SPLITS", "causal_work_per_cp_rank", "cp_work_imbalance"]

CP_SPLITS: tuple[str, ...] = ("zigzag", "contiguous")
"""Ways of splitting a packed row over CP ranks that :func:`causal_work_per_cp_rank` measures."""


def _lengths(name: str, values: object) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D sequence of ints, got {values!r:.80}")
    array = array.astype(np.int64)
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0, got {array.tolist()!r:.80}")
    return array


def _triangle(n: np.ndarray) -> np.ndarray:
    """Work of the causal queries at positions ``0 .. n - 1`` of a sequence: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


def _range_work(lo: np.ndarray, hi: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Work of the queries at positions ``[lo, hi)`` below ``limit`` of each sequence (element-wise)."""
    return _triangle(np.minimum(hi, limit)) - _triangle(np.minimum(lo, limit))


def _row_work(real: np.ndarray, cp: int, split: str, multiple: int, count: str) -> np.ndarray:
    """``[cp]`` work of one packed row of documents with ``real`` lengths."""
    if split == "zigzag":
        padded = -(-real // multiple) * multiple
        chunk = padded // (2 * cp)
        limit = real if count == "real" else padded
        ranks = np.arange(cp)[:, None]
        first = _range_work(ranks * chunk, (ranks + 1) * chunk, limit)
        second = _range_work((2 * cp - 1 - ranks) * chunk, (2 * cp - ranks) * chunk, limit)
        return (first + second).sum(axis=1)
    total = int(real.sum())
    padded_total = -(-total // cp) * cp
    segments = np.append(real, padded_total - total)  # the padding tail is computed like a sequence
    limit = np.append(real, 0) if count == "real" else segments
    starts = np.concatenate([[0], np.cumsum(segments)[:-1]])
    piece = padded_total // cp
    bounds = np.arange(cp + 1)[:, None] * piece - starts  # rank r holds [bounds[r], bounds[r + 1]) of each segment
    clipped = np.clip(bounds, 0, segments)
    return _range_work(clipped[:-1], clipped[1:], limit).sum(axis=1)


def causal_work_per_cp_rank(
    lengths_or_bins: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    cp_size: int,
    *,
    split: str = "zigzag",
    document_multiple: int | None = None,
    count: str = "computed",
) -> np.ndarray:
    """Causal attention work (query-key pairs) of every CP rank, for one packed row or for each of many.

    Args:
        lengths_or_bins: the real lengths of the documents of one packed row, or a sequence of rows (bins, e.g.
            the microbatches of a plan: ``[[lengths[i] for i in mb] for mb in plan.rank_microbatches(0)]``).
        cp_size: context-parallel ranks.
        split: ``"zigzag"`` (chunks ``r`` and ``2 cp - 1 - r`` of every document) or ``"contiguous"`` (the row
            cut into ``cp`` consecutive pieces, the row padded at its end to a multiple of ``cp``).
        document_multiple: zigzag pads every document to a multiple of this (default ``2 * cp_size``; it must
            be a multiple of ``2 * cp_size``).
        count: ``"computed"`` counts every position the kernel computes (padding included); ``"real"`` counts
            real queries only (each attends to real keys only, padding sits at the ends).

    Returns:
        ``int64`` work of shape ``[cp]`` for one row, ``[num_rows, cp]`` for rows.

    Example:
        >>> causal_work_per_cp_rank([[6, 2], [4]], 2).tolist()
        [[23, 23], [5, 5]]
    """
    cp = check_int("cp_size", cp_size, minimum=1)
    if split not in CP_SPLITS:
        raise ValueError(f"split must be one of {CP_SPLITS}, got {split!r}")
    if count not in ("computed", "real"):
        raise ValueError(f"count must be 'computed' or 'real', got {count!r}")
    multiple = 2 * cp if document_multiple is None else check_int("document_multiple", document_multiple, minimum=1)
    if multiple % (2 * cp):
        raise ValueError(f"document_multiple={multiple} must be a multiple of 2 x cp_size = {2 * cp}")
    if isinstance(lengths_or_bins, np.ndarray):
        is_rows = lengths_or_bins.ndim == 2
    else:
        is_rows = any(isinstance(row, (Sequence, np.ndarray)) for row in lengths_or_bins)
    if not is_rows:
        return _row_work(_lengths("lengths", lengths_or_bins), cp, split, multiple, count)
    rows = [_row_work(_lengths(f"bins[{i}]", row), cp, split, multiple, count) for i, row in enumerate(lengths_or_bins)]
    return np.stack(rows) if rows else np.zeros((0, cp), dtype=np.int64)


def cp_work_imbalance(work: np.ndarray) -> np.ndarray | float:
    """``max / mean`` of the per-rank work of each row (1.0 is perfect balance; a row without work counts 1.0).

    Example:
        >>> cp_work_imbalance(np.array([[10, 26], [5, 5]])).tolist()
        [1.4444444444444444, 1.0]
    """
    work = np.asarray(work, dtype=np.float64)
    if work.ndim not in (1, 2) or work.shape[-1] == 0:
        raise ValueError(f"work must be [cp] or [rows, cp], got shape {work.shape}")
    mean = work.mean(axis=-1)
    ratio = np.divide(work.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)
    return float(ratio) if work.ndim == 1 else ratio
