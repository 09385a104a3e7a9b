"""The strategy's device mesh: this process's data-, context- and tensor-parallel size and rank.

**The strategy's device mesh is the source of truth** for data-parallel size and rank. :func:`mesh_layout` reads a
``DeviceMesh`` whose dimensions are recognised by name::

    data parallel      data_parallel, dp, dp_replicate, dp_shard, replicate, shard, ddp, fsdp   (several: row-major)
    context parallel   context_parallel, cp
    tensor parallel    tensor_parallel, tp

Lightning's ``ModelParallelStrategy`` mesh is ``("data_parallel", "tensor_parallel")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_seqpack.parallel.layout import ParallelLayout

__all__ = ["MeshLayout", "check_mesh", "mesh_layout", "strategy_mesh"]


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
