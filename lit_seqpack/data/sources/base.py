"""What a source is: :class:`IndexedSource` (map-style data, one dataset per split) or a
:class:`~lit_seqpack.data.sources.streams.StreamSource` (read in order), and :func:`resolve_source`, which turns
what a user passes as ``source=`` into one of them.

Any map-style dataset whose items are dicts with ``input_ids`` is a source too (a ``torch.utils.data.Dataset``
subclass, a list of dicts, a ``datasets.Dataset``): it is its own training split. In YAML, a class of your own is
chosen by ``class_path`` with no registration::

    data:
      source:
        class_path: my_pkg.MyDataset     # a torch.utils.data.Dataset subclass, or an IndexedSource
        init_args: {path: data/train.bin}

The one string shortcut is ``"synthetic"`` (the embedded task with its defaults).

What a dataset declares so the planner never reads a sample to learn its size: the :class:`TokenDataset` protocol.

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

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lit_seqpack.data.sources.streams import StreamSource

__all__ = [
    "SHORTCUTS",
    "DatasetSource",
    "IndexedSource",
    "resolve_source",
    "source_splits",
    "COUNT_ATTRIBUTES",
    "TokenDataset",
    "declared_counts",
    "declared_fingerprint",
    "lengths_change_per_epoch",
]


COUNT_ATTRIBUTES: tuple[str, ...] = ("lengths", "loss_tokens")
"""The per-sample count arrays a dataset may declare."""


@runtime_checkable
class TokenDataset(Protocol):
    """A map-style dataset of token samples that declares its per-sample counts and a content identity.

    ``isinstance(dataset, TokenDataset)`` checks that the attributes exist (not their values: the DataModule checks
    the declared counts against the samples when it scans them).

    Example:
        >>> from lit_seqpack.data.sources.tokenized import TokenizedDataset
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
        >>> from lit_seqpack.data.sources.tokenized import TokenizedDataset
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


SHORTCUTS: tuple[str, ...] = ("synthetic",)
"""The sources a string may name."""


class IndexedSource(ABC):
    """A source of map-style token datasets: the one of each split it holds.

    Subclass it (and implement :meth:`load`) for a source with settings of its own, e.g. files with a validation
    file beside them (:class:`~lit_seqpack.data.sources.files.FileSource`); a plain dataset needs no subclass.
    """

    @abstractmethod
    def load(
        self, split: str, *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> Sequence[Mapping[str, Any]] | None:
        """The dataset of ``split`` (``"train"``, ``"val"`` or ``"test"``), or ``None`` when this source has none.

        Items are dicts with ``input_ids`` and optionally ``labels`` or ``loss_mask`` and the declared
        ``token_fields`` / ``sample_fields``.
        """

    def splits(self) -> tuple[str, ...]:
        """The splits this source holds (:meth:`load` returns ``None`` for the others): the training split alone."""
        return ("train",)


class DatasetSource(IndexedSource):
    """A ready map-style dataset as a source: its own training split, no validation or test split.

    Example:
        >>> source = DatasetSource([{"input_ids": [5, 6]}])
        >>> len(source.load("train")), source.load("val")
        (1, None)
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]]) -> None:
        self.dataset = dataset

    def load(
        self, split: str, *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> Sequence[Mapping[str, Any]] | None:
        """The dataset for ``"train"`` (its samples carry whatever fields they carry), ``None`` otherwise."""
        return self.dataset if split == "train" else None

    def __repr__(self) -> str:
        return f"DatasetSource({type(self.dataset).__name__}, {len(self.dataset)} samples)"


def resolve_source(value: object, setting: str = "source") -> IndexedSource | StreamSource:
    """What ``setting`` names, as a source object.

    Args:
        value: an :class:`IndexedSource`, a :class:`~lit_seqpack.data.sources.streams.StreamSource`, a map-style
            dataset (``len`` and ``[i]``), or a shortcut string (:data:`SHORTCUTS`).
        setting: the setting's name, for messages (``"source"``, ``"val_source"``, ``"test_source"``).

    Raises:
        ValueError: an unknown string, or an object that is neither a source nor a map-style dataset.

    Example:
        >>> type(resolve_source("synthetic")).__name__
        'DatasetSource'
        >>> resolve_source("jsonl")
        Traceback (most recent call last):
        ...
        ValueError: source='jsonl' is not a built-in source name (only 'synthetic' is): pass an object, ...
    """
    if isinstance(value, (IndexedSource, StreamSource)):
        return value
    if isinstance(value, str):
        if value == "synthetic":
            from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset

            return DatasetSource(SyntheticInstructionDataset())
        raise ValueError(
            f"{setting}={value!r} is not a built-in source name (only 'synthetic' is): pass an object, e.g. "
            f"{setting}=TokenizedSource(path=...) in Python or {setting}: {{class_path: "
            "lit_seqpack.data.sources.TokenizedSource, init_args: {path: ...}} in YAML"
        )
    if callable(getattr(value, "load", None)) and not hasattr(value, "__getitem__"):
        return value  # type: ignore[return-value] # an IndexedSource by duck typing
    if hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, Mapping):
        return DatasetSource(value)  # type: ignore[arg-type]
    raise ValueError(
        f"{setting} must be a map-style dataset (len and [i] returning dicts with input_ids), an IndexedSource, a "
        f"StreamSource or 'synthetic', got {type(value).__name__}"
    )


def source_splits(source: object) -> tuple[str, ...]:
    """The splits an indexed source holds: its :meth:`IndexedSource.splits`, or ``("train",)`` when it declares none.

    Example:
        >>> source_splits(DatasetSource([{"input_ids": [5]}]))
        ('train',)
    """
    splits = getattr(source, "splits", None)
    return tuple(splits()) if callable(splits) else ("train",)
