"""Deterministic train/validation splits as index views (no copy of the data), and the way back to a source index.

Reading a user's samples: an exception raised by ``dataset[i]`` names the dataset index and the dataset's class.

A user's ``__getitem__`` that fails (a missing file, a decoding error, a bug) would otherwise surface with no index,
at setup (the validation scan) or mid-epoch (a DataLoader worker), and the sample could not be found again. The
exception is raised again with ``dataset[i] (MyDataset) raised ...`` in front of its message, of the same type when
that type takes a message (else a ``RuntimeError``), chained to the original (``raise ... from err``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lit_seqpack.data.batching.overlong import DroppedDataset, SplitDataset, TruncatedDataset

__all__ = [
    "HeldOut",
    "IndexView",
    "Split",
    "source_index",
    "split_indices",
    "trained_in",
    "read_sample",
    "sample_error",
]


class Split(NamedTuple):
    """One split of the data as the planner sees it."""

    dataset: IndexView
    lengths: np.ndarray
    loss_tokens: np.ndarray


def split_indices(
    num_samples: int, val_fraction: float, *, seed: int, test_fraction: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``range(num_samples)`` into sorted train, validation and test indices, the same on every rank.

    Args:
        num_samples: size of the dataset.
        val_fraction: share held out for validation, in ``[0, 1)``; at least one sample when positive.
        seed: seed of the permutation.
        test_fraction: share held out for testing, likewise.

    Example:
        >>> train, val, test = split_indices(10, 0.2, seed=0, test_fraction=0.1)
        >>> len(train), len(val), len(test)
        (7, 2, 1)
        >>> sorted(np.concatenate([train, val, test]).tolist()) == list(range(10))
        True
    """
    counts = []
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name}={fraction!r} must be in [0, 1)")
        counts.append(0 if fraction == 0 else max(1, round(num_samples * fraction)))
    num_val, num_test = counts
    if num_val + num_test >= num_samples and num_samples:
        raise ValueError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} leave no training sample "
            f"out of {num_samples}"
        )
    order = np.random.default_rng(seed).permutation(num_samples)
    held = num_val + num_test
    return np.sort(order[held:]), np.sort(order[:num_val]), np.sort(order[num_val:held])


class HeldOut(NamedTuple):
    """What decides the held-out splits of a dataset: its size after the over-long policy, the fractions, the seed."""

    num_samples: int
    val_fraction: float
    test_fraction: float
    seed: int

    def indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The train, validation and test indices (:func:`split_indices`)."""
        return split_indices(self.num_samples, self.val_fraction, seed=self.seed, test_fraction=self.test_fraction)


def trained_in(trained: HeldOut, evaluated: HeldOut, split: str) -> tuple[int, int]:
    """How many samples of split ``split`` (``"val"`` or ``"test"``) under ``evaluated`` were trained on under
    ``trained``, and the split's size; ``(0, size)`` for data of another size (nothing can be said).

    Example:
        >>> trained = HeldOut(100, val_fraction=0.1, test_fraction=0.0, seed=0)
        >>> trained_in(trained, trained._replace(test_fraction=0.05), "test")
        (5, 5)
        >>> trained_in(trained, trained, "val")
        (0, 10)
    """
    part = {"val": 1, "test": 2}[split]
    held = evaluated.indices()[part]
    if trained.num_samples != evaluated.num_samples:
        return 0, len(held)
    return int(np.intersect1d(trained.indices()[0], held).size), len(held)


class IndexView:
    """``view[i] == dataset[indices[i]]``: a split of a dataset without copying it (see :class:`Split`).

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


def source_index(dataset: Any, index: int) -> int:
    """The index in the original dataset of ``dataset[index]``, through split, drop, truncate and piece views (a piece
    of ``overlong="split"`` maps to the sample it was cut from).

    Example:
        >>> source_index(IndexView(list(range(10)), [2, 5, 7]), 1)
        5
    """
    while True:
        if isinstance(dataset, IndexView):
            index, dataset = int(dataset.indices[index]), dataset.dataset
        elif isinstance(dataset, (DroppedDataset, SplitDataset)):
            index, dataset = int(dataset.original_indices[index]), dataset.dataset
        elif isinstance(dataset, TruncatedDataset):
            dataset = dataset.dataset
        else:
            return index


EVAL_SPLITS: tuple[str, ...] = ("val", "test")


def _original(dataset: Any) -> Any:
    """The dataset under the data layer's views (split, drop, truncate), whose class the user wrote."""
    from lit_seqpack.data.batching.overlong import DroppedDataset, SplitDataset, TruncatedDataset
    from lit_seqpack.data.indexed.splits import IndexView

    while isinstance(dataset, (IndexView, DroppedDataset, TruncatedDataset, SplitDataset)):
        dataset = dataset.dataset
    return dataset


def sample_error(dataset: Any, index: int, err: Exception) -> Exception:
    """The exception to raise (``from err``) for ``err`` raised by ``dataset[index]``, naming the original index.

    Example:
        >>> print(sample_error([], 17, IndexError("no row 17 in shard 2")))
        dataset[17] (list) raised IndexError: no row 17 in shard 2
    """
    where = f"dataset[{source_index(dataset, index)}] ({type(_original(dataset)).__name__})"
    message = f"{where} raised {type(err).__name__}: {err}"
    try:
        named = type(err)(message)
    except Exception:  # an exception type whose constructor takes other arguments
        return RuntimeError(message)
    return named if message in str(named) else RuntimeError(message)


def read_sample(dataset: Any, index: int) -> Mapping[str, Any]:
    """``dataset[index]``; an exception it raises is raised again naming the index (:func:`sample_error`)."""
    try:
        return dataset[index]
    except Exception as err:
        raise sample_error(dataset, index, err) from err
