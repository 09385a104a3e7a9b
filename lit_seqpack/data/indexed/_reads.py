"""Reading a user's samples: an exception raised by ``dataset[i]`` names the dataset index and the dataset's class.

A user's ``__getitem__`` that fails (a missing file, a decoding error, a bug) would otherwise surface with no index,
at setup (the validation scan) or mid-epoch (a DataLoader worker), and the sample could not be found again. The
exception is raised again with ``dataset[i] (MyDataset) raised ...`` in front of its message, of the same type when
that type takes a message (else a ``RuntimeError``), chained to the original (``raise ... from err``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_seqpack.data.indexed.splits import source_index

__all__ = ["read_sample", "sample_error"]


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
