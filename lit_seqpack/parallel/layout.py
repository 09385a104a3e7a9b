"""The parallel layout: how global ranks split into data-, context- and tensor-parallel groups.

:class:`ParallelLayout` orders global ranks tensor-parallel innermost, then context-parallel, then
data-parallel, and derives every pad multiple from the context- and tensor-parallel sizes, so the planner, the
collator and the model cannot disagree.

The strategy's device mesh: this process's data-, context- and tensor-parallel size and rank.

**The strategy's device mesh is the source of truth** for data-parallel size and rank. :func:`mesh_layout` reads a
``DeviceMesh`` whose dimensions are recognised by name::

    data parallel      data_parallel, dp, dp_replicate, dp_shard, replicate, shard, ddp, fsdp   (several: row-major)
    context parallel   context_parallel, cp
    tensor parallel    tensor_parallel, tp

Lightning's ``ModelParallelStrategy`` mesh is ``("data_parallel", "tensor_parallel")``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from lit_seqpack._checks import check_int

__all__ = [
    "DataParallelLayout",
    "ParallelLayout",
    "RankCoordinates",
    "MeshLayout",
    "check_mesh",
    "mesh_layout",
    "strategy_mesh",
]


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


_KINDS = {
    **dict.fromkeys(("data_parallel", "dp", "dp_replicate", "dp_shard", "replicate", "shard", "ddp", "fsdp"), "dp"),
    **dict.fromkeys(("context_parallel", "cp"), "cp"),
    **dict.fromkeys(("tensor_parallel", "tp"), "tp"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshLayout:
    """This process's place in a device mesh: the size and rank of its data-, context- and tensor-parallel groups."""

    data_parallel_size: int
    data_parallel_rank: int
    context_parallel_size: int = 1
    context_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0


def strategy_mesh(strategy: Any) -> Any:
    """The ``device_mesh`` of a strategy (``None`` when it has none, e.g. DDP, FSDP1, DeepSpeed)."""
    has_mesh = hasattr(type(strategy), "device_mesh") or "device_mesh" in getattr(strategy, "__dict__", {})
    if strategy is None or not has_mesh:
        return None
    return strategy.device_mesh  # ModelParallelStrategy raises if asked before the processes are initialised


def mesh_layout(mesh: Any) -> MeshLayout:
    """Data-, context- and tensor-parallel size and rank of this process, read from a ``DeviceMesh``.

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh``; its dimensions are classified by name (see the
            module docstring); a 1-D mesh without names is data parallel.

    Raises:
        ValueError: a dimension whose name says nothing about what it splits (e.g. ``"pp"``): the planner cannot
            know whether its ranks need the same or different microbatches.
    """
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"the strategy's {mesh.ndim}-D device mesh has no dimension names: name them (e.g. "
                "mesh_dim_names=('data_parallel', 'tensor_parallel')) so the DataModule knows which ranks share data"
            )
        names = ("data_parallel",)
    sizes = {"dp": 1, "cp": 1, "tp": 1}
    ranks = {"dp": 0, "cp": 0, "tp": 0}
    for dim, name in enumerate(names):
        kind = _KINDS.get(name)
        if kind is None:
            data = sorted(k for k, v in _KINDS.items() if v == "dp")
            raise ValueError(
                f"the strategy's device mesh has a dimension {name!r} (of {tuple(names)}) that SeqPackDataModule "
                f"cannot place: name data-parallel dimensions one of {data}, context-parallel 'cp' or "
                "'context_parallel', tensor-parallel 'tp' or 'tensor_parallel'"
            )
        size, rank = int(mesh.size(dim)), int(mesh.get_local_rank(dim))
        ranks[kind] = ranks[kind] * size + rank  # several dimensions of one kind: row-major
        sizes[kind] *= size
    return MeshLayout(
        data_parallel_size=sizes["dp"],
        data_parallel_rank=ranks["dp"],
        context_parallel_size=sizes["cp"],
        context_parallel_rank=ranks["cp"],
        tensor_parallel_size=sizes["tp"],
        tensor_parallel_rank=ranks["tp"],
    )


def check_mesh(mesh: MeshLayout, parallel: ParallelLayout, world_size: int, global_rank: int) -> None:
    """Fail unless the mesh agrees with the DataModule's parallel sizes (and, with CP, with its rank order).

    Raises:
        ValueError: naming the mesh's value and the DataModule setting it contradicts.
    """
    for name in ("context_parallel_size", "tensor_parallel_size"):
        own, theirs = getattr(parallel, name), getattr(mesh, name)
        if own != theirs:
            raise ValueError(
                f"the strategy's device mesh has {name.removesuffix('_size')} size {theirs} but "
                f"SeqPackDataModule({name}={own}): set {name}={theirs} (the mesh is the source of truth; the "
                "ranks that share a data-parallel rank must get the same microbatches)"
            )
    total = mesh.data_parallel_size * parallel.model_parallel_size
    if total != world_size:
        raise ValueError(
            f"the strategy's device mesh spans data_parallel x context_parallel x tensor_parallel = "
            f"{mesh.data_parallel_size} x {mesh.context_parallel_size} x {mesh.tensor_parallel_size} = {total} ranks "
            f"but the world size is {world_size}"
        )
    if parallel.context_parallel_size > 1:
        expected = (mesh.data_parallel_rank, mesh.context_parallel_rank, mesh.tensor_parallel_rank)
        if parallel.coordinates(global_rank) != expected:
            raise ValueError(
                f"global rank {global_rank} is (dp, cp, tp) = {expected} in the strategy's device mesh, but "
                "lit_seqpack's context-parallel groups assume the order tensor-parallel innermost, then "
                f"context-parallel, then data-parallel, which gives {parallel.coordinates(global_rank)}: order the "
                "mesh dimensions (data_parallel, context_parallel, tensor_parallel)"
            )
