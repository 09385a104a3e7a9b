"""The parallel layout: how global ranks split into data-, context- and tensor-parallel groups.

:class:`ParallelLayout` orders global ranks tensor-parallel innermost, then context-parallel, then
data-parallel, and derives every pad multiple from the context- and tensor-parallel sizes, so the planner, the
collator and the model cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from lit_seqpack._checks import check_int

__all__ = ["DataParallelLayout", "ParallelLayout", "RankCoordinates"]


class DataParallelLayout(NamedTuple):
    """What a plan is made for: data-parallel ranks, this process's data-parallel rank, microbatches per step.

    Example:
        >>> layout = DataParallelLayout(world_size=4, rank=1, accumulate_grad_batches=2)
        >>> layout.world_size, layout.rank, layout.accumulate_grad_batches
        (4, 1, 2)
    """

    world_size: int = 1
    """Data-parallel ranks (context- and tensor-parallel ranks of one data-parallel rank count once)."""
    rank: int = 0
    """This process's data-parallel rank."""
    accumulate_grad_batches: int = 1
    """Microbatches per rank per optimizer step."""


class RankCoordinates(NamedTuple):
    """Where one global rank sits: its data-, context- and tensor-parallel rank (:meth:`ParallelLayout.coordinates`).

    Example:
        >>> RankCoordinates(data_parallel_rank=1, context_parallel_rank=0, tensor_parallel_rank=1).tensor_parallel_rank
        1
    """

    data_parallel_rank: int
    context_parallel_rank: int
    tensor_parallel_rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How ranks split the work, and the pad multiples that follow from it (the single source of truth).

    Global ranks are laid out tensor-parallel innermost, then context-parallel, then data-parallel (Megatron's
    default order): ``global_rank = (dp_rank * cp + cp_rank) * tp + tp_rank``. The ``cp * tp`` ranks of one
    data-parallel rank get the same microbatches; only data-parallel ranks get different ones.

    * ``document_multiple``: with CP every document is padded to a multiple of ``2 * cp * tp`` (``2 * cp`` equal
      chunks, each split evenly by sequence parallelism), combined (lcm) with the user's own multiple.
    * ``row_multiple``: sequence parallelism alone (``cp == 1``) splits the packed row, not each document, into
      ``tp`` shards, so the row length must be a multiple of ``tp``; with CP the row is a multiple of
      ``document_multiple`` (its padding tail is a segment split like a document).

    Args:
        context_parallel_size: ranks that split every sequence (``cp``).
        tensor_parallel_size: tensor-parallel ranks with sequence parallelism (``tp``).

    Example:
        >>> layout = ParallelLayout(context_parallel_size=2, tensor_parallel_size=2)
        >>> layout.document_multiple(pad_to_multiple_of=3), layout.row_multiple(sequence_length_round=8)
        (24, 8)
        >>> tuple(layout.coordinates(global_rank=6)), layout.data_parallel_size(world_size=8)
        ((1, 1, 0), 2)
    """

    context_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_int("context_parallel_size", self.context_parallel_size, minimum=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one data-parallel rank's microbatches: ``cp * tp``."""
        return self.context_parallel_size * self.tensor_parallel_size

    def document_multiple(self, pad_to_multiple_of: int = 1) -> int:
        """Every document is padded to a multiple of this (``pad_to_multiple_of`` itself when ``cp == 1``)."""
        own = check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
        return math.lcm(own, 2 * self.model_parallel_size) if self.context_parallel_size > 1 else own

    def row_multiple(self, sequence_length_round: int = 1, pad_to_multiple_of: int = 1) -> int:
        """Every packed row is padded to a multiple of this (``sequence_length_round`` when ``cp == tp == 1``)."""
        own = check_int("sequence_length_round", sequence_length_round, minimum=1)
        if self.context_parallel_size > 1:
            return math.lcm(own, self.document_multiple(pad_to_multiple_of))
        return math.lcm(own, self.tensor_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks among ``world_size`` processes (``ValueError`` unless ``cp * tp`` divides it)."""
        world = check_int("world_size", world_size, minimum=1)
        if world % self.model_parallel_size:
            raise ValueError(
                f"world_size={world} is not a multiple of context_parallel_size x tensor_parallel_size = "
                f"{self.context_parallel_size} x {self.tensor_parallel_size}"
            )
        return world // self.model_parallel_size

    def coordinates(self, global_rank: int) -> RankCoordinates:
        """The data-, context- and tensor-parallel rank of a global rank."""
        rank = check_int("global_rank", global_rank, minimum=0)
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return RankCoordinates(rank // (cp * tp), (rank // tp) % cp, rank % tp)

    def context_parallel_groups(self, world_size: int) -> list[list[int]]:
        """The global ranks of every CP group, each listed by CP rank (for ``new_subgroups_by_enumeration``)."""
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return [
            [(dp * cp + c) * tp + t for c in range(cp)]
            for dp in range(self.data_parallel_size(world_size))
            for t in range(tp)
        ]
