"""Deterministic train/validation splits as index views (no copy of the data)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["IndexView", "split_indices"]


def split_indices(num_samples: int, val_fraction: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(num_samples)`` into sorted train and validation indices, the same on every rank.

    Args:
        num_samples: size of the dataset.
        val_fraction: share held out for validation, in ``[0, 1)``; at least one sample when positive.
        seed: seed of the permutation.

    Example:
        >>> train, val = split_indices(10, 0.2, seed=0)
        >>> len(train), len(val), sorted(np.concatenate([train, val]).tolist()) == list(range(10))
        (8, 2, True)
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
    num_val = 0 if val_fraction == 0 else max(1, round(num_samples * val_fraction))
    if num_val >= num_samples and num_samples:
        raise ValueError(f"val_fraction={val_fraction} leaves no training sample out of {num_samples}")
    order = np.random.default_rng(seed).permutation(num_samples)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


class IndexView:
    """``view[i] == dataset[indices[i]]``; lengths and loss tokens follow when the dataset offers them.

    Args:
        dataset: a map-style dataset.
        indices: the positions of ``dataset`` in the view, in order.
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]], indices: np.ndarray) -> None:
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return self.dataset[int(self.indices[index])]
