"""How ranks split the work, shared by the data and model layers (neither imports the other's collators or models).

* :mod:`~lit_seqpack.parallel.layout`: :class:`ParallelLayout`, the rank order and every pad multiple;
  :class:`DataParallelLayout`, the data-parallel world size, rank and accumulation a plan is made for.
* :mod:`~lit_seqpack.parallel.context`: context-parallel sharding of packed rows (:func:`shard_packed_batch`,
  :func:`gather_packed_batches`, :func:`shard_tokens`, :func:`unshard_tokens`, :func:`context_parallel_index`).
* :mod:`~lit_seqpack.parallel.layout`: the strategy's device mesh, the source of truth for the data-parallel size
  and rank (:func:`strategy_mesh`, :func:`mesh_layout`, :func:`check_mesh`).
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DataParallelLayout": "lit_seqpack.parallel.layout",
    "ParallelLayout": "lit_seqpack.parallel.layout",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
