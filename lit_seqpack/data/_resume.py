"""What a DataModule checkpoint records, and the checks that a resume trains exactly the remaining batches.

A checkpoint holds the facts the plan depends on (the data, the distributed layout, the mode and budget), the
plan settings (seed, shuffle, algorithm, window, ...) and the training loader's state. Resuming with a fact
changed would replay a different plan from the middle, so it is refused at restore time with a message naming
every difference; changed plan settings are refused mid-epoch only (a new epoch is planned afresh anyway).

:func:`check_start` is the second line: when the training loop starts drawing batches, the sampler's start must
be the Trainer's own batch counter (which decides when the optimizer steps) and an optimizer-step boundary.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lit_seqpack.data._loader import sampler_state_of
from lit_seqpack.data.splits import Split
from lit_seqpack.planning.plan import PlanConfig

__all__ = [
    "LOADER_STATE",
    "PLAN_SETTINGS",
    "check_resume",
    "check_start",
    "digest",
    "layout_state",
    "plan_settings",
    "rewind_fit_loop",
]

log = logging.getLogger(__name__)

LOADER_STATE = "train_loader"
PLAN_STATE = "plan_settings"
PLAN_SETTINGS = (
    "seed",
    "shuffle",
    "algorithm",
    "window",
    "batch_size",
    "sequence_length_round",
    "microbatch_order",
    "cost_linear",
    "cost_quadratic",
)
"""The plan settings a mid-epoch resume must keep (besides the layout facts of :func:`layout_state`)."""


def plan_settings(config: PlanConfig) -> dict[str, Any]:
    """The :data:`PLAN_SETTINGS` of a training plan configuration."""
    return {name: getattr(config, name) for name in PLAN_SETTINGS}


def digest(lengths: np.ndarray, loss_tokens: np.ndarray) -> str:
    """A short digest of the training lengths and loss tokens: same digest, same plans."""
    return hashlib.sha256(np.concatenate([lengths, loss_tokens]).astype(np.int64).tobytes()).hexdigest()[:16]


def layout_state(
    *,
    num_samples: int,
    train: Split | None,
    world_size: int,
    context_parallel_size: int,
    tensor_parallel_size: int,
    accumulate_grad_batches: int,
    mode: str,
    max_tokens: int | None,
) -> dict[str, Any]:
    """The facts a resumed run must agree with (everything but the loader state of a checkpoint).

    Args:
        num_samples: samples of the whole dataset.
        train: the training split, or ``None`` before ``setup``.
        world_size: data-parallel ranks.
        context_parallel_size: ranks that split every sequence.
        tensor_parallel_size: tensor-parallel ranks.
        accumulate_grad_batches: microbatches per rank per optimizer step.
        mode: the batching mode.
        max_tokens: token budget of a microbatch.
    """
    return {
        "num_samples": num_samples,
        "num_train_samples": 0 if train is None else len(train[0]),
        "train_lengths": None if train is None else digest(train[1], train[2]),
        "world_size": world_size,
        "context_parallel_size": context_parallel_size,
        "tensor_parallel_size": tensor_parallel_size,
        "accumulate_grad_batches": accumulate_grad_batches,
        "mode": mode,
        "max_tokens": max_tokens,
    }


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    changed = {k: (v, current.get(k)) for k, v in saved.items() if current.get(k) != v}
    return ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())


def check_resume(
    state_dict: Mapping[str, Any], current: Mapping[str, Any], settings: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any] | None, tuple[int, int] | None]:
    """Refuse a checkpoint planned for other data, layout or (mid-epoch) settings; return its loader state.

    Args:
        state_dict: the checkpoint's DataModule state (layout facts and, optionally, the plan settings and the
            loader state).
        current: :func:`layout_state` of the DataModule now.
        settings: :func:`plan_settings` of the DataModule now (``None``: not checked).

    Returns:
        The training loader's state and the ``(epoch, microbatch)`` it resumes at (``None`` without one).

    Raises:
        ValueError: a fact of the checkpoint differs from now, or a plan setting differs and the checkpoint is
            mid-epoch; every difference is named with both values.
    """
    saved = dict(state_dict)
    loader_state = saved.pop(LOADER_STATE, None)
    saved_settings = saved.pop(PLAN_STATE, None)
    if detail := _differences(saved, current):
        raise ValueError(
            f"cannot resume: the checkpoint was planned for other data or another layout ({detail}); "
            "resume with the same dataset, world size, accumulate_grad_batches, mode and max_tokens"
        )
    point = None
    if loader_state:
        sampler = sampler_state_of(loader_state)
        point = int(sampler["epoch"]), int(sampler["position"])
    mid_epoch = point is not None and point[1] > 0
    if (
        mid_epoch
        and saved_settings is not None
        and settings is not None
        and (detail := _differences(saved_settings, settings))
    ):
        raise ValueError(
            f"cannot resume mid-epoch (epoch {point[0]}, microbatch {point[1]}) with other plan settings "
            f"({detail}): the rest of the epoch would follow another plan, training some samples twice and "
            "others never. Resume with the checkpoint's settings, or from an end-of-epoch checkpoint"
        )
    return loader_state, point


def check_start(
    *,
    trainer_epoch: int,
    trainer_position: int,
    saved: tuple[int, int] | None,
    accumulate: int,
    rewind: Callable[[int], bool] | None = None,
) -> tuple[int, int]:
    """Where a training iteration must start: the Trainer's epoch and batch counter, checked against the checkpoint.

    Lightning groups microbatches into optimizer steps by its own counter and ends the epoch by it, so the
    sampler must start where the counter stands, whatever happened to the loader state on the way (restored
    before or after the loader was built, with another worker count, or not at all). A checkpoint of an earlier
    epoch is fine: Lightning closed that epoch early (``max_steps``, ``limit_train_batches``) and starts the next.

    A checkpoint written inside a gradient-accumulation window holds the weights of the step's start but not the
    gradient of its first microbatches: the resume goes back to the step's start (``rewind`` moves the Trainer's
    counter back) and trains those microbatches again, so the step gets its whole gradient.

    Args:
        trainer_epoch: the epoch the Trainer is training.
        trainer_position: microbatches of that epoch the Trainer counts as trained.
        saved: the ``(epoch, microbatch)`` of the checkpoint's loader state, on the first iteration after a
            restore (``None`` otherwise).
        accumulate: microbatches per optimizer step.
        rewind: moves the Trainer's counter back by the given number of microbatches; returns ``False`` when it
            cannot (``None``: never).

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
    """
    epoch = trainer_epoch
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
    try:
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    except ImportError:  # another Lightning: refuse rather than guess
        return False
    progress = getattr(getattr(fit_loop, "epoch_loop", None), "batch_progress", None)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if type(fetcher) is not _PrefetchDataFetcher:  # e.g. a training_step(dataloader_iter) fetches batches itself
        return False
    names = ("ready", "started", "processed", "completed")
    try:
        counts = {getattr(progress.current, name) for name in names} | {fetcher.fetched}
        totals = [getattr(progress.total, name) for name in names]
    except AttributeError:
        return False
    if len(counts) != 1 or counts.pop() < microbatches or min(totals) < microbatches or getattr(fetcher, "batches", []):
        return False
    for tracker in (progress.current, progress.total):
        for name in names:
            setattr(tracker, name, getattr(tracker, name) - microbatches)
    fetcher.fetched -= microbatches
    return True
