"""``PlannedDataset``: a map-style dataset whose batched reads carry the batch sampler's microbatch metadata.

A planned batch sampler yields :class:`~lit_seqpack.batch.Microbatch` lists of indices with a
:class:`~lit_seqpack.batch.MicrobatchMeta`; wrapping the dataset in :class:`PlannedDataset` hands the collator the
samples as a ``Microbatch`` with the same metadata and the original dataset indices (named in its errors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lit_seqpack.batch import Microbatch
from lit_seqpack.data.indexed._reads import read_sample
from lit_seqpack.data.indexed.splits import source_index

__all__ = ["IndexedCollator", "PlannedDataset", "SourceIndices"]


class PlannedDataset:
    """Wraps a map-style dataset so that a batch sampler's :class:`Microbatch` metadata reaches the collator.

    Use it to wire a planned batch sampler and a collator into a plain ``DataLoader`` by hand (the DataModule does
    it for you).

    Args:
        dataset: any object with ``__getitem__`` and ``__len__`` returning sample mappings.

    Example:
        >>> planned = PlannedDataset([{"input_ids": [5, 6]}, {"input_ids": [7]}])
        >>> batch = planned.__getitems__(Microbatch([1, 0], meta=None))
        >>> [sample["input_ids"] for sample in batch], list(batch.indices)
        ([[7], [5, 6]], [1, 0])
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return read_sample(self.dataset, index)

    def __getitems__(self, indices: Sequence[int]) -> Microbatch:
        return Microbatch(
            (read_sample(self.dataset, i) for i in indices),
            meta=getattr(indices, "meta", None),
            indices=SourceIndices(self.dataset, indices),
        )


class SourceIndices(Sequence[int]):
    """The original dataset indices of a microbatch's samples, resolved only when asked (in an error message).

    Args:
        dataset: the (possibly split, dropped or truncated) dataset the indices point into.
        indices: positions in ``dataset``.
    """

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self._dataset, self._indices = dataset, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, position: Any) -> Any:
        # the data layer's views (split, drop, truncate) know how to map back; resolved on the error path only
        if isinstance(position, slice):
            return [source_index(self._dataset, int(i)) for i in self._indices[position]]
        return source_index(self._dataset, int(self._indices[position]))

    def __reduce__(self) -> tuple[Any, ...]:  # never ship the dataset: the resolved indices are small
        return (list, (list(self),))


class IndexedCollator:
    """A collator that also writes ``sample_index``: each document's index in the source, in batch order.

    ``sample_index`` is int64 ``[num_documents]``: in ``cu_seqlens`` order for a packed row, one per row for a padded
    batch, empty for a lock-step filler. The indices are the source's (through split, drop and truncate views), as
    :class:`PlannedDataset` attaches them; ``trainer.predict`` returns them with each sample's outputs.

    Args:
        collate: the mode's collator (:class:`~lit_seqpack.data.batching.collate.PackedCollator`, ...).

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> planned = PlannedDataset([{"input_ids": [5, 6]}, {"input_ids": [7]}])
        >>> IndexedCollator(PackedCollator())(planned.__getitems__(Microbatch([1, 0])))["sample_index"].tolist()
        [1, 0]
    """

    def __init__(self, collate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        indices = getattr(samples, "indices", None)
        if indices is None and len(samples):
            raise ValueError("IndexedCollator needs the samples' indices: read them through PlannedDataset")
        batch = self.collate(samples)
        batch["sample_index"] = torch.tensor([int(i) for i in indices or ()], dtype=torch.int64)
        return batch
