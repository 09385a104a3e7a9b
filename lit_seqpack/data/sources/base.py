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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from lit_seqpack.data.sources.streams import StreamSource

__all__ = ["SHORTCUTS", "DatasetSource", "IndexedSource", "resolve_source", "source_splits"]

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
