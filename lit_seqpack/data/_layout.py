"""The distributed layout a DataModule plans for: world size, rank and accumulation, split into parallel groups.

The layout is read from the ``Trainer`` (or a Fabric object) when there is one (refusing
``use_distributed_sampler=True``, which would wrap the planned batch sampler), otherwise from an initialised
``torch.distributed`` process group, otherwise a single process.

**The strategy's device mesh is the source of truth.** Under ``ModelParallelStrategy`` (FSDP2 + TP), or any
strategy with a ``device_mesh``, the data-parallel size and rank are read from the mesh
(:func:`lit_seqpack.parallel.mesh_layout`, which also names the dimensions it recognises) and checked against the
DataModule's ``tensor_parallel_size`` / ``context_parallel_size`` (:func:`lit_seqpack.parallel.check_mesh`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lit_seqpack.parallel import MeshLayout, ParallelLayout, check_mesh, mesh_layout, strategy_mesh

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["MeshLayout", "check_mesh", "mesh_layout", "read_layout", "read_world", "strategy_mesh"]


def read_world(trainer: Trainer | None) -> tuple[int, int, int]:
    """Global world size, global rank and gradient accumulation of this process.

    Args:
        trainer: the DataModule's Trainer, or ``None`` outside one (then ``torch.distributed`` is asked).

    Raises:
        ValueError: a multi-rank Trainer runs with ``use_distributed_sampler=True``.
    """
    if trainer is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank(), 1
        return 1, 0, 1
    if trainer.world_size > 1 and trainer._accelerator_connector.use_distributed_sampler:
        raise ValueError(
            "SeqPackDataModule plans every rank's batches itself: create the Trainer with "
            "use_distributed_sampler=False (Lightning would otherwise wrap the batch sampler in a "
            "DistributedSampler and ranks would get different batch counts and hang)"
        )
    return trainer.world_size, trainer.global_rank, trainer.accumulate_grad_batches


def read_layout(
    trainer: Any, parallel: ParallelLayout, *, fabric: Any = None, accumulate_grad_batches: int = 1
) -> tuple[tuple[int, int, int], int]:
    """The data-parallel layout this process plans for, and its context-parallel rank.

    Args:
        trainer: the DataModule's Trainer, or ``None``.
        parallel: the context and tensor parallel sizes.
        fabric: a Lightning ``Fabric`` to read the world size, rank and mesh from when there is no Trainer.
        accumulate_grad_batches: the accumulation of a Fabric loop (the Trainer's own value is read otherwise).

    Returns:
        ``((data-parallel world size, data-parallel rank, accumulation), context-parallel rank)``.

    Raises:
        ValueError: the strategy's device mesh contradicts ``parallel`` (see :func:`check_mesh`).
    """
    if trainer is None and fabric is not None:
        world, rank, accumulate, owner = fabric.world_size, fabric.global_rank, accumulate_grad_batches, fabric
    else:
        (world, rank, accumulate), owner = read_world(trainer), trainer
    mesh = strategy_mesh(getattr(owner, "strategy", None))
    if mesh is not None:
        layout = mesh_layout(mesh)
        check_mesh(layout, parallel, world, rank)
        return (layout.data_parallel_size, layout.data_parallel_rank, accumulate), layout.context_parallel_rank
    dp_rank, cp_rank, _ = parallel.coordinates(rank)
    return (parallel.data_parallel_size(world), dp_rank, accumulate), cp_rank
