"""Collators for context and tensor parallelism: each rank's batch of a packed (or padded) microbatch.

:class:`ContextParallelCollator` collates the whole microbatch and keeps this rank's context-parallel shard
(:func:`~lit_seqpack.parallel.shard_packed_batch`, drawn in :mod:`lit_seqpack.parallel`); declared token fields are
sharded with the tokens and get their ``shift_<name>`` like ``shift_labels``. :class:`TensorParallelCollator` only
records the tensor-parallel size. The layout, sharding and mesh functions live in :mod:`lit_seqpack.parallel`
(shared by the data and model layers); they are re-exported here so the old import paths keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lit_seqpack._checks import check_int
from lit_seqpack.data.batching.collate import PackedCollator
from lit_seqpack.parallel.context import shard_packed_batch

__all__ = ["ContextParallelCollator", "TensorParallelCollator"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextParallelCollator:
    """A :class:`~lit_seqpack.data.batching.collate.PackedCollator` whose output is this rank's context-parallel shard.

    Args:
        collator: collates the whole microbatch; its ``pad_document_to_multiple_of`` (and ``pad_to_multiple_of``
            unless ``None``) must be multiples of ``2 * context_parallel_size`` (take both from
            :class:`ParallelLayout`).
        context_parallel_size: CP ranks (``cp``).
        context_parallel_rank: this process's CP rank.
        tensor_parallel_size: tensor-parallel ranks (recorded in the batch as ``tensor_parallel_size``, so the
            model side can check the trainer's world size).
    """

    collator: PackedCollator
    context_parallel_size: int
    context_parallel_rank: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.collator, PackedCollator):
            raise ValueError(f"collator must be a PackedCollator, got {type(self.collator).__name__}")
        cp = check_int("context_parallel_size", self.context_parallel_size, minimum=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if not 0 <= check_int("context_parallel_rank", self.context_parallel_rank, minimum=0) < cp:
            raise ValueError(f"context_parallel_rank must be in [0, {cp}), got {self.context_parallel_rank}")
        for name in ("pad_document_to_multiple_of", "pad_to_multiple_of"):
            value = getattr(self.collator, name)
            if value is None and name == "pad_to_multiple_of":
                continue  # rows of padded documents are multiples already
            if cp > 1 and (value or 1) % (2 * cp):
                raise ValueError(f"collator.{name}={value} must be a multiple of 2 x context_parallel_size={2 * cp}")

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = shard_packed_batch(
            self.collator(samples),
            self.context_parallel_size,
            self.context_parallel_rank,
            token_fields=self.collator.token_fields,
        )
        batch["tensor_parallel_size"] = self.tensor_parallel_size
        return batch


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelCollator:
    """A collator whose batches record ``tensor_parallel_size`` (tensor parallelism without context parallelism).

    Sequence parallelism splits the whole row (or ``L``) into ``tp`` equal parts, never a document, so the wrapped
    collator only pads rows to a multiple of ``tp`` (``ParallelLayout.row_multiple``) and documents keep any
    length. The model side reads ``tensor_parallel_size`` to check the trainer's world size.

    Args:
        collator: the packed or padded collator of the microbatch (rows padded to a multiple of ``tp``).
        tensor_parallel_size: tensor-parallel ranks (``tp``).
    """

    collator: Any
    tensor_parallel_size: int

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self.collator(samples)
        width = batch["input_ids"].shape[-1]
        if width % self.tensor_parallel_size:
            raise ValueError(
                f"the collated row has {width} tokens, not a multiple of tensor_parallel_size="
                f"{self.tensor_parallel_size}: collate with pad_to_multiple_of a multiple of it"
            )
        batch["tensor_parallel_size"] = self.tensor_parallel_size
        return batch
