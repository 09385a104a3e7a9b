"""What the data pipelines read from the Trainer: the layout they plan for and where training resumes.

The distributed layout a DataModule plans for: world size, rank and accumulation, split into parallel groups.

The layout is read from the ``Trainer`` (or a Fabric object) when there is one (refusing
``use_distributed_sampler=True``, which would wrap the planned batch sampler), otherwise from an initialised
``torch.distributed`` process group, otherwise a single process.

**The strategy's device mesh is the source of truth.** Under ``ModelParallelStrategy`` (FSDP2 + TP), or any
strategy with a ``device_mesh``, the data-parallel size and rank are read from the mesh
(:func:`lit_seqpack.parallel.layout.mesh_layout`, which also names the dimensions it recognises) and checked against the
DataModule's ``tensor_parallel_size`` / ``context_parallel_size`` (:func:`lit_seqpack.parallel.layout.check_mesh`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lit_seqpack.parallel import DataParallelLayout, ParallelLayout
from lit_seqpack.parallel.layout import check_mesh, mesh_layout, strategy_mesh

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "check_start",
    "read_layout",
    "read_world",
    "restart_epoch",
    "rewind_fit_loop",
    "training_start",
]

log = logging.getLogger(__name__)


def read_world(trainer: Trainer | None) -> DataParallelLayout:
    """Global world size, global rank and gradient accumulation of this process (before the model-parallel split).

    Args:
        trainer: the DataModule's Trainer, or ``None`` outside one (then ``torch.distributed`` is asked).

    Raises:
        ValueError: a multi-rank Trainer runs with ``use_distributed_sampler=True``.
    """
    if trainer is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return DataParallelLayout(dist.get_world_size(), dist.get_rank(), 1)
        return DataParallelLayout()
    if trainer.world_size > 1 and trainer._accelerator_connector.use_distributed_sampler:
        raise ValueError(
            "SeqPackDataModule plans every rank's batches itself: create the Trainer with "
            "use_distributed_sampler=False (Lightning would otherwise wrap the batch sampler in a "
            "DistributedSampler and ranks would get different batch counts and hang)"
        )
    return DataParallelLayout(trainer.world_size, trainer.global_rank, trainer.accumulate_grad_batches)


def read_layout(
    trainer: Any, parallel: ParallelLayout, *, fabric: Any = None, accumulate_grad_batches: int = 1
) -> tuple[DataParallelLayout, int]:
    """The data-parallel layout this process plans for, and its context-parallel rank.

    Args:
        trainer: the DataModule's Trainer, or ``None``.
        parallel: the context and tensor parallel sizes.
        fabric: a Lightning ``Fabric`` to read the world size, rank and mesh from when there is no Trainer.
        accumulate_grad_batches: the accumulation of a Fabric loop (the Trainer's own value is read otherwise).

    Returns:
        ``(data-parallel layout, context-parallel rank)``.

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
        data = DataParallelLayout(layout.data_parallel_size, layout.data_parallel_rank, accumulate)
        return data, layout.context_parallel_rank
    dp_rank, cp_rank, _ = parallel.coordinates(rank)
    return DataParallelLayout(parallel.data_parallel_size(world), dp_rank, accumulate), cp_rank


def check_start(
    *,
    trainer_epoch: int,
    trainer_position: int,
    saved: tuple[int, int] | None,
    accumulate: int,
    rewind: Callable[[int], bool] | None = None,
    restart: Callable[[int], bool] | None = None,
) -> tuple[int, int]:
    """Where a training iteration must start: the Trainer's epoch and batch counter, checked against the checkpoint.

    Lightning groups microbatches into optimizer steps by its own counter and ends the epoch by it, so the
    sampler must start where the counter stands, whatever happened to the loader state on the way (restored
    before or after the loader was built, with another worker count, or not at all). A checkpoint of an earlier
    epoch is fine: Lightning closed that epoch early (``max_steps``, ``limit_train_batches``) and starts the next.

    A checkpoint written inside a gradient-accumulation window holds the weights of the step's start but not the
    gradient of its first microbatches: the resume goes back to the step's start (``rewind`` moves the Trainer's
    counter back) and trains those microbatches again, so the step gets its whole gradient.

    A checkpoint written after the last microbatch of an epoch resumes at the next epoch's start; when Lightning
    still counts the finished epoch's microbatches there (the new epoch is longer: the layout changed), ``restart``
    sets its counter back to 0.

    Args:
        trainer_epoch: the epoch the Trainer is training.
        trainer_position: microbatches of that epoch the Trainer counts as trained.
        saved: the ``(epoch, microbatch)`` of the checkpoint's loader state, on the first iteration after a
            restore (``None`` otherwise).
        accumulate: microbatches per optimizer step.
        rewind: moves the Trainer's counter back by the given number of microbatches; returns ``False`` when it
            cannot (``None``: never).
        restart: starts the Trainer's epoch afresh when its counter stands at the given number of microbatches of
            the checkpoint's finished epoch (:func:`restart_epoch`); returns ``False`` when it cannot (``None``: never).

    Returns:
        ``(trainer_epoch, position)``: ``trainer_position``, or the start of its optimizer step.

    Raises:
        RuntimeError: the checkpoint's loader is at a later epoch than the Trainer, or in the same epoch at neither
            the Trainer's position nor one microbatch past it (a checkpoint written while that microbatch trained);
            or the Trainer resumes inside a gradient-accumulation window and its counter cannot be moved back.

    Example:
        >>> check_start(trainer_epoch=1, trainer_position=6, saved=(1, 6), accumulate=2)
        (1, 6)
        >>> check_start(trainer_epoch=1, trainer_position=7, saved=(1, 7), accumulate=2, rewind=lambda n: True)
        (1, 6)
        >>> check_start(trainer_epoch=1, trainer_position=14, saved=(1, 0), accumulate=2, restart=lambda n: True)
        (1, 0)
    """
    epoch = trainer_epoch
    if saved == (epoch, 0) and trainer_position > 0 and restart is not None and restart(trainer_position):
        log.info(
            "The checkpoint was written after the last microbatch of epoch %d (%d microbatches of its layout): "
            "epoch %d starts at its first microbatch.",
            epoch - 1,
            trainer_position,
            epoch,
        )
        return epoch, 0
    if saved is not None and (saved[0] > epoch or (saved[0] == epoch and saved[1] - trainer_position not in (0, 1))):
        raise RuntimeError(
            f"cannot resume exactly: the checkpoint's loader stopped at epoch {saved[0]}, microbatch {saved[1]} "
            f"but the Trainer's loop resumes at epoch {epoch}, microbatch {trainer_position}; the run would train "
            "some samples twice or skip them. Resume from a checkpoint written by ModelCheckpoint"
        )
    step, done = divmod(trainer_position, accumulate)
    if done and rewind is not None and rewind(done):
        log.info(
            "The checkpoint was written inside a gradient-accumulation window (epoch %d, after microbatch %d of the "
            "%d of optimizer step %d) and holds no partial gradient: resuming from the step's start, microbatch %d.",
            epoch,
            done,
            accumulate,
            step,
            trainer_position - done,
        )
        return epoch, trainer_position - done
    if done:
        raise RuntimeError(
            f"cannot resume exactly: the checkpoint was written inside a gradient-accumulation window (epoch "
            f"{epoch}, after microbatch {done} of the {accumulate} of optimizer step {step}). It does not hold the "
            f"gradient accumulated so far, so step {step} would be taken with part of its gradient lost. Resume "
            "from a checkpoint written at an optimizer-step boundary (ModelCheckpoint(every_n_train_steps=...) "
            "and save_last write there), or set accumulate_grad_batches=1 for runs checkpointed at any microbatch"
        )
    return trainer_epoch, trainer_position


def _restored_progress(fit_loop: Any, microbatches: int) -> tuple[Any, Any, int] | None:
    """Lightning's batch progress, its data fetcher and the microbatches done, when the counters agree on at least
    ``microbatches`` done (this epoch and in total) and nothing is prefetched.

    ``None`` for anything else: another Lightning version, a ``training_step`` that takes ``dataloader_iter``.
    """
    try:
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    except ImportError:  # another Lightning: refuse rather than guess
        return None
    progress = getattr(getattr(fit_loop, "epoch_loop", None), "batch_progress", None)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if type(fetcher) is not _PrefetchDataFetcher:  # e.g. a training_step(dataloader_iter) fetches batches itself
        return None
    names = ("ready", "started", "processed", "completed")
    try:
        counts = {getattr(progress.current, name) for name in names} | {fetcher.fetched}
        totals = [getattr(progress.total, name) for name in names]
    except AttributeError:
        return None
    if len(counts) != 1 or min(*counts, *totals) < microbatches or getattr(fetcher, "batches", []):
        return None
    return progress, fetcher, counts.pop()


def rewind_fit_loop(fit_loop: Any, microbatches: int) -> bool:
    """Move a restarted Lightning fit loop back by ``microbatches`` trained microbatches of the current epoch.

    Called at the first batch after a restore, when Lightning's batch progress and its data fetcher agree on the
    microbatches done (``ready == started == processed == completed == fetched``, nothing prefetched) and the
    fetcher is Lightning's default one; anything else (another Lightning version, a ``training_step`` that takes
    ``dataloader_iter``) returns ``False`` and the caller refuses the checkpoint.

    Args:
        fit_loop: ``trainer.fit_loop``.
        microbatches: how many to move back.
    """
    restored = _restored_progress(fit_loop, microbatches)
    if restored is None:
        return False
    progress, fetcher, _ = restored
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(tracker, name, getattr(tracker, name) - microbatches)
    fetcher.fetched -= microbatches
    return True


def restart_epoch(fit_loop: Any, microbatches: int) -> bool:
    """Start a restored fit loop's epoch at its first microbatch, as Lightning does when an epoch ends.

    A checkpoint written after the last microbatch of an epoch (in ``on_train_batch_end``: a
    ``ModelCheckpoint(every_n_train_steps=...)`` landing on it, a callback) restores Lightning's batch counter at
    that epoch's length, flagged as its last batch. Lightning moves on to the next epoch but resets the counter
    only when it reaches the new epoch's length, which it does not when the new layout plans a longer epoch (fewer
    ranks, a smaller ``max_tokens``). This resets what Lightning resets there: the batch, scheduler and optimizer
    progress of the epoch and the validation batches of the epoch (the totals stay: those microbatches trained).

    Args:
        fit_loop: ``trainer.fit_loop``.
        microbatches: the batch counter Lightning restored (the finished epoch's length).

    Returns:
        ``False`` (nothing changed) unless the counters agree on ``microbatches`` done, the last of them was the
        epoch's last batch, and the fit loop is Lightning's default one (see :func:`rewind_fit_loop`).
    """
    restored = _restored_progress(fit_loop, microbatches)
    if restored is None or restored[2] != microbatches or restored[0].is_last_batch is not True:
        return False
    progress, fetcher, _ = restored
    epoch_loop = fit_loop.epoch_loop
    try:
        resets = (
            epoch_loop.scheduler_progress.reset_on_run,
            epoch_loop.automatic_optimization.optim_progress.reset_on_run,
            epoch_loop.val_loop.batch_progress.total.reset,
        )
    except AttributeError:
        return False
    for reset in (progress.reset_on_run, *resets):
        reset()
    fetcher.fetched -= microbatches
    return True


def training_start(
    trainer: Any, epoch: int, start: int, saved: tuple[int, int] | None, accumulate: int
) -> tuple[int, int]:
    """Where an iteration of a training loader starts: the Trainer's epoch and batch counter during ``fit``.

    Outside ``fit`` (or with a stand-in trainer) the loader's own ``(epoch, start)`` stands; during ``fit`` the
    Trainer's counters are checked against ``saved``, the checkpoint's loader position (:func:`check_start`), and a
    resume inside a gradient-accumulation window goes back to the step's start (:func:`rewind_fit_loop`); one after
    the last microbatch of an epoch starts the next epoch at 0 (:func:`restart_epoch`).

    Args:
        trainer: the DataModule's Trainer, or ``None``.
        epoch: the loader's own epoch.
        start: the loader's own position in it (microbatches).
        saved: the checkpoint's ``(epoch, microbatch)`` on the first iteration after a restore, else ``None``.
        accumulate: microbatches per rank per optimizer step.
    """
    if not getattr(trainer, "training", False):
        return epoch, start
    loop = trainer.fit_loop
    return check_start(
        trainer_epoch=loop.epoch_progress.current.processed,
        trainer_position=loop.epoch_loop.batch_progress.current.ready,
        saved=saved,
        accumulate=accumulate,
        rewind=lambda microbatches: rewind_fit_loop(loop, microbatches),
        restart=lambda microbatches: restart_epoch(loop, microbatches),
    )
