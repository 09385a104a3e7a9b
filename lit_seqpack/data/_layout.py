"""The distributed layout a DataModule plans for: world size, rank and accumulation, split into parallel groups.

The layout is read from the ``Trainer`` when there is one (refusing ``use_distributed_sampler=True``, which
would wrap the planned batch sampler), otherwise from an initialised ``torch.distributed`` process group,
otherwise a single process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lit_seqpack.data.context_parallel import ParallelLayout

__all__ = ["read_layout", "read_world"]


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


def read_layout(trainer: Trainer | None, parallel: ParallelLayout) -> tuple[tuple[int, int, int], int]:
    """The data-parallel layout this process plans for, and its context-parallel rank.

    Args:
        trainer: the DataModule's Trainer, or ``None``.
        parallel: the context and tensor parallel sizes.

    Returns:
        ``((data-parallel world size, data-parallel rank, accumulation), context-parallel rank)``.
    """
    world, rank, accumulate = read_world(trainer)
    dp_rank, cp_rank, _ = parallel.coordinates(rank)
    return (parallel.data_parallel_size(world), dp_rank, accumulate), cp_rank
