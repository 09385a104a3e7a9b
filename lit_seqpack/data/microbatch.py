"""What travels from a batch sampler to the collator: dataset indices plus the plan's step metadata.

A DataLoader hands the object its batch sampler yields to ``dataset.__getitems__`` (when the dataset
defines it) and that method's return value to ``collate_fn``. The samplers yield :class:`Microbatch`
lists of indices carrying a :class:`MicrobatchMeta`; :class:`PlannedDataset` fetches the samples and
returns them as a :class:`Microbatch` with the same metadata, so the collator can put the exact-loss
normaliser (the loss tokens of the whole optimizer step over all ranks) into the batch without any
collective. Both classes pickle, so they cross DataLoader worker processes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Microbatch", "MicrobatchMeta", "PlannedDataset"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MicrobatchMeta:
    """Plan facts about one microbatch that the model side needs.

    Args:
        step: index of the optimizer step within the epoch.
        step_loss_tokens: loss tokens of every microbatch of this optimizer step, summed over all ranks.
        world_size: number of ranks the plan was made for.
        accumulate_grad_batches: microbatches per rank per optimizer step in the plan.
        max_tokens: the token budget of a microbatch (``None`` for the padded baseline).
        is_empty: the plan had no sample for this slot (lock-step filler); the collator emits a
            zero-weight dummy batch.
        loss_tokens: the loss tokens the plan counted for this microbatch (``None``: not checked); the
            collator compares them with the samples' labels, so a wrong count cannot skew the exact loss.
        step_loss_weight: the loss-weight sum of this optimizer step over all ranks, for a weighted loss
            (:mod:`lit_seqpack.data.loss_weights`); ``None`` without one.
    """

    step: int
    step_loss_tokens: int
    world_size: int
    accumulate_grad_batches: int
    max_tokens: int | None = None
    is_empty: bool = False
    loss_tokens: int | None = None
    step_loss_weight: float | None = None

    def __post_init__(self) -> None:
        if self.step_loss_tokens < 0:
            raise ValueError(f"step_loss_tokens must be >= 0, got {self.step_loss_tokens}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {self.accumulate_grad_batches}")
        if self.step_loss_weight is not None and not self.step_loss_weight >= 0:
            raise ValueError(f"step_loss_weight must be >= 0 or None, got {self.step_loss_weight}")


class Microbatch(list):
    """A ``list`` (of dataset indices, or of samples) with an optional :class:`MicrobatchMeta`.

    Example:
        >>> mb = Microbatch([3, 1], meta=None)
        >>> list(mb), mb.meta
        ([3, 1], None)
    """

    __slots__ = ("indices", "meta")

    def __init__(
        self, items: Iterable[Any] = (), meta: MicrobatchMeta | None = None, indices: Sequence[int] | None = None
    ) -> None:
        super().__init__(items)
        self.meta = meta
        self.indices = indices  # the dataset indices of fetched samples (named in the collators' errors)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Microbatch, (list(self), self.meta, self.indices))

    def __repr__(self) -> str:
        return f"Microbatch({list.__repr__(self)}, meta={self.meta!r})"


class PlannedDataset:
    """Wraps a map-style dataset so that a batch sampler's :class:`Microbatch` metadata reaches the collator.

    Args:
        dataset: any object with ``__getitem__`` and ``__len__`` returning sample mappings.
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Microbatch:
        return Microbatch(
            (self.dataset[i] for i in indices),
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
        if isinstance(position, slice):
            return [source_index(self._dataset, int(i)) for i in self._indices[position]]
        return source_index(self._dataset, int(self._indices[position]))

    def __reduce__(self) -> tuple[Any, ...]:  # never ship the dataset: the resolved indices are small
        return (list, (list(self),))


def source_index(dataset: Any, index: int) -> int:
    """The index in the original dataset of ``dataset[index]``, through split, drop and truncate views.

    Example:
        >>> from lit_seqpack.data.splits import IndexView
        >>> source_index(IndexView(list(range(10)), [2, 5, 7]), 1)
        5
    """
    from lit_seqpack.data.overlong import DroppedDataset, TruncatedDataset
    from lit_seqpack.data.splits import IndexView

    while True:
        if isinstance(dataset, IndexView):
            index, dataset = int(dataset.indices[index]), dataset.dataset
        elif isinstance(dataset, DroppedDataset):
            index, dataset = int(dataset.original_indices[index]), dataset.dataset
        elif isinstance(dataset, TruncatedDataset):
            dataset = dataset.dataset
        else:
            return index
