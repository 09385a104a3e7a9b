"""Where this process sits among data-parallel ranks, and the one gather of per-sample results over ranks."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from lit_seqpack.planning.rollout import RolloutPlan

__all__ = ["DataParallelWorld", "check_same_rollout", "gather_per_sample", "resolve_world"]

_DIFFERENT_ROLLOUTS = (
    "the ranks planned different rollouts (their Rollout.fingerprint() differ: {digests}): every rank must hold the "
    "same rollout. A DataLoader of rollouts (or prompts) needs use_distributed_sampler=False (or generate on every "
    "rank with the same seed and gather)"
)


class DataParallelWorld(NamedTuple):
    """The data-parallel ranks and this process's rank among them.

    Example:
        >>> DataParallelWorld(world_size=4, rank=1).world_size
        4
    """

    world_size: int = 1
    """Data-parallel ranks."""
    rank: int = 0
    """This process's data-parallel rank."""


def resolve_world(trainer: Any = None) -> DataParallelWorld:
    """The data-parallel world: the trainer's (its device mesh first), ``torch.distributed``'s, or one rank."""
    if trainer is not None:
        from lit_seqpack.parallel import mesh_layout, strategy_mesh

        mesh = strategy_mesh(getattr(trainer, "strategy", None))
        if mesh is not None:
            layout = mesh_layout(mesh)
            if layout.context_parallel_size * layout.tensor_parallel_size != 1:
                raise ValueError(
                    "RolloutPlanner supports data parallelism only; the device mesh has context x tensor parallel "
                    f"= {layout.context_parallel_size} x {layout.tensor_parallel_size}"
                )
            return DataParallelWorld(layout.data_parallel_size, layout.data_parallel_rank)
        return DataParallelWorld(int(trainer.world_size), int(trainer.global_rank))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DataParallelWorld(dist.get_world_size(), dist.get_rank())
    return DataParallelWorld()


def gather_per_sample(
    values: list[torch.Tensor | None], plan: RolloutPlan, lengths: np.ndarray, rank: int, fingerprint: str
) -> list[torch.Tensor | None]:
    """Fill every entry of ``values`` with the owning rank's tensor (one ``all_gather`` of flat values).

    Every rank knows from the plan which samples each rank computed and how long they are, so only the values
    travel: each rank sends its samples' values concatenated in plan order, padded to the longest rank's total.
    A small object gather first exchanges the dtype and the rollout's ``fingerprint``: ranks that planned
    different rollouts (e.g. a DataLoader sharded by a ``DistributedSampler``) raise instead of mixing values.
    """
    import torch.distributed as dist

    world_size = plan.config.world_size
    owned = [[i for _, _, mb in plan.rank_microbatches(r) for i in mb] for r in range(world_size)]
    mine = [values[i] for i in owned[rank]]
    if any(v is None for v in mine):
        raise RuntimeError("compute_per_token: a sample of this rank has no value (fn skipped a batch?)")
    meta: list[Any] = [None] * world_size
    first = mine[0] if mine else None
    described = None if first is None else (first.dtype, tuple(first.shape[1:]), str(first.device))
    dist.all_gather_object(meta, (fingerprint, described))
    _raise_unless_equal([m[0] for m in meta])
    meta = [m[1] for m in meta]
    known = next(m for m in meta if m is not None)
    dtype, trailing = known[0], known[1]
    if first is not None:
        device = first.device
    else:  # a rank without samples (more ranks than samples) sends zeros from the backend's device
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
    totals = [int(lengths[o].sum()) for o in owned]
    width = max(totals)
    flat = torch.zeros((width, *trailing), dtype=dtype, device=device)
    if mine:
        flat[: totals[rank]] = torch.cat(mine)
    buffers = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(buffers, flat)
    out = list(values)
    for r in range(world_size):
        for i, part in zip(owned[r], buffers[r][: totals[r]].split(lengths[owned[r]].tolist()), strict=True):
            out[i] = part
    return out


def check_same_rollout(fingerprint: str, world_size: int) -> None:
    """Raise on every rank unless all ``world_size`` ranks hold the rollout of ``fingerprint`` (one
    ``all_gather_object`` of the digest over the default process group).

    Raises:
        ValueError: the default process group is not the planner's data-parallel group.
        RuntimeError: the ranks' digests differ (on every rank, so none waits for the others).
    """
    import torch.distributed as dist

    if dist.get_world_size() != world_size:
        raise ValueError(
            f"check_rollout compares the rollout over the default process group ({dist.get_world_size()} ranks) "
            f"but the planner has {world_size} data-parallel ranks; pass check_rollout=False and compare "
            "Rollout.fingerprint() over your data-parallel group"
        )
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, fingerprint)
    _raise_unless_equal(digests)


def _raise_unless_equal(digests: list[str]) -> None:
    if len(set(digests)) > 1:
        shown = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise RuntimeError(_DIFFERENT_ROLLOUTS.format(digests=shown))
