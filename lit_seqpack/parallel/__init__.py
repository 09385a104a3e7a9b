"""How ranks split the work, shared by the data and model layers (neither imports the other's collators or models).

* :mod:`~lit_seqpack.parallel.layout`: :class:`ParallelLayout`, the rank order and every pad multiple;
  :class:`DataParallelLayout`, the data-parallel world size, rank and accumulation a plan is made for.
* :mod:`~lit_seqpack.parallel.context`: context-parallel sharding of packed rows (:func:`shard_packed_batch`,
  :func:`gather_packed_batches`, :func:`shard_tokens`, :func:`unshard_tokens`, :func:`context_parallel_index`).
* :mod:`~lit_seqpack.parallel.mesh`: the strategy's device mesh, the source of truth for the data-parallel size
  and rank (:func:`strategy_mesh`, :func:`mesh_layout`, :func:`check_mesh`).
"""

from lit_seqpack.parallel.context import (
    SHIFT_PREFIX,
    context_parallel_index,
    gather_packed_batches,
    shard_packed_batch,
    shard_tokens,
    shift_tokens,
    unshard_tokens,
)
from lit_seqpack.parallel.layout import DataParallelLayout, ParallelLayout
from lit_seqpack.parallel.mesh import MeshLayout, check_mesh, mesh_layout, strategy_mesh

__all__ = [
    "SHIFT_PREFIX",
    "DataParallelLayout",
    "MeshLayout",
    "ParallelLayout",
    "check_mesh",
    "context_parallel_index",
    "gather_packed_batches",
    "mesh_layout",
    "shard_packed_batch",
    "shard_tokens",
    "shift_tokens",
    "strategy_mesh",
    "unshard_tokens",
]
