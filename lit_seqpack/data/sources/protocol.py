"""What a dataset declares so the planner never reads a sample to learn its size: the :class:`TokenDataset` protocol.

Any map-style dataset of token samples works (``len`` and ``dataset[i] -> {"input_ids": ..., "labels"?: ...}``);
one that also declares ``lengths``, ``loss_tokens`` and ``fingerprint`` is planned without a pass over the data and
its scan is cached under its fingerprint. A dataset whose samples change between epochs (augmentation, a prompt that
grows) declares ``lengths_change_per_epoch = True``: it is then never cached and is re-scanned and re-planned at the
start of every epoch (after its ``set_epoch(epoch)``, when it has one). Every dataset of
:mod:`lit_seqpack.data.sources` implements the whole
protocol. A dataset may declare only part of it (say ``lengths`` alone); :func:`declared_counts` and
:func:`declared_fingerprint` are the one place that reads a declaration, and the rest is computed from the samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["COUNT_ATTRIBUTES", "TokenDataset", "declared_counts", "declared_fingerprint", "lengths_change_per_epoch"]

COUNT_ATTRIBUTES: tuple[str, ...] = ("lengths", "loss_tokens")
"""The per-sample count arrays a dataset may declare."""


@runtime_checkable
class TokenDataset(Protocol):
    """A map-style dataset of token samples that declares its per-sample counts and a content identity.

    ``isinstance(dataset, TokenDataset)`` checks that the attributes exist (not their values: the DataModule checks
    the declared counts against the samples when it scans them).

    Example:
        >>> from lit_seqpack.data.sources import TokenizedDataset
        >>> isinstance(TokenizedDataset.from_records([{"input_ids": [5, 6]}]), TokenDataset)
        True
        >>> isinstance([{"input_ids": [5, 6]}], TokenDataset)
        False
    """

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        """Sample ``index``: ``{"input_ids": ..., "labels"?: ... | "loss_mask"?: ...}``, unshifted."""
        ...

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sample, ``[len(self)]`` integers."""
        ...

    @property
    def loss_tokens(self) -> np.ndarray:
        """Trained targets of every sample (labels other than -100 after the first token), ``[len(self)]``."""
        ...

    @property
    def fingerprint(self) -> str | None:
        """A stable identity of the content (keys the lengths cache), or ``None`` when there is none."""
        ...


def declared_counts(dataset: object, name: str) -> np.ndarray | None:
    """The ``lengths`` or ``loss_tokens`` array ``dataset`` declares, or ``None`` when it declares none.

    Integer arrays keep their dtype (``int32`` stays ``int32``); anything else is read as ``int64``. A method of
    that name is not a declaration.

    Args:
        dataset: any dataset.
        name: one of :data:`COUNT_ATTRIBUTES`.

    Raises:
        ValueError: the declared array does not hold integers, or not one per sample.

    Example:
        >>> from lit_seqpack.data.sources import TokenizedDataset
        >>> declared_counts(TokenizedDataset.from_records([{"input_ids": [5, 6]}]), "lengths").tolist()
        [2]
        >>> declared_counts([{"input_ids": [5, 6]}], "lengths") is None
        True
    """
    if name not in COUNT_ATTRIBUTES:
        raise ValueError(f"name={name!r} must be one of {COUNT_ATTRIBUTES}")
    value = getattr(dataset, name, None)
    if value is None or callable(value):
        return None
    array = np.asarray(value)
    if array.dtype.kind not in "iu" and array.size:  # 2.5 tokens would be read as 2: refuse instead
        raise ValueError(f"dataset.{name} must hold integers, got dtype {array.dtype}")
    if array.dtype not in (np.int32, np.int64):
        array = array.astype(np.int64)
    if array.shape != (len(dataset),):  # type: ignore[arg-type]
        raise ValueError(f"dataset.{name} has shape {array.shape} but the dataset has {len(dataset)} samples")  # type: ignore[arg-type]
    return array


def declared_fingerprint(dataset: object) -> str | None:
    """The ``fingerprint`` ``dataset`` declares (a stable identity of its content), or ``None``.

    Raises:
        TypeError: the fingerprint is not a ``str``.
    """
    value = getattr(dataset, "fingerprint", None)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"dataset.fingerprint must be a str or None, got {type(value).__name__}")
    return value


def lengths_change_per_epoch(dataset: object) -> bool:
    """Whether ``dataset`` declares ``lengths_change_per_epoch = True``: its samples (and so their lengths and loss
    tokens) may change from one epoch to the next, so it is re-scanned and re-planned every epoch.

    Raises:
        TypeError: the attribute is not a bool.

    Example:
        >>> class Growing(list):
        ...     lengths_change_per_epoch = True
        >>> lengths_change_per_epoch(Growing()), lengths_change_per_epoch([])
        (True, False)
    """
    value = getattr(dataset, "lengths_change_per_epoch", False)
    if not isinstance(value, bool):
        raise TypeError(f"dataset.lengths_change_per_epoch must be True or False, got {value!r}")
    return value
