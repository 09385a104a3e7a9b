"""What a DataModule checkpoint records, and the checks that a resume trains exactly the remaining batches.

A checkpoint holds the facts the plan depends on (the data, the distributed layout, the mode and budget), the
plan settings (seed, shuffle, algorithm, window, ...) and the training loader's state. Resuming with a fact
changed would replay a different plan from the middle, so it is refused at restore time with a message naming
every difference. A new epoch is planned afresh anyway, so changed plan settings are refused mid-epoch only, and
at an epoch boundary the run may continue on another world size, accumulation or ``max_tokens``
(:data:`ELASTIC`): the next epoch is planned for the new layout.

:func:`~lit_seqpack.data._trainer.check_start` is the second line: when the training loop starts drawing batches,
the sampler's start must be the Trainer's own batch counter (which decides when the optimizer steps) and an
optimizer-step boundary.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from lit_seqpack.data.indexed._loader import sampler_state_of
from lit_seqpack.data.indexed.splits import Split
from lit_seqpack.planning.plan import PlanConfig

__all__ = [
    "ELASTIC",
    "LOADER_STATE",
    "PLAN_SETTINGS",
    "Restore",
    "check_resume",
    "digest",
    "layout_state",
    "plan_settings",
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
ELASTIC = ("world_size", "accumulate_grad_batches", "max_tokens")
"""The layout facts of :func:`layout_state` a checkpoint written at an epoch boundary may change."""


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


def _point(point: tuple[int, int]) -> str:
    return f"epoch {point[0]}, microbatch {point[1]}"


class Restore(NamedTuple):
    """What :func:`check_resume` found in a checkpoint."""

    loader_state: dict[str, Any] | None
    """The training loader's state (``None``: the checkpoint holds none)."""
    point: tuple[int, int] | None
    """The ``(epoch, microbatch)`` the loader resumes at; microbatch 0 is an epoch boundary."""
    layout_changes: str
    """The :data:`ELASTIC` settings that changed, each with both values (``""``: the same layout)."""


def _strict_facts(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The saved facts that must not change; a changed ``max_tokens`` may re-truncate the training lengths."""
    strict = {k: v for k, v in saved.items() if k not in ELASTIC}
    if saved.get("max_tokens") != current.get("max_tokens") and saved.get("num_train_samples") == current.get(
        "num_train_samples"
    ):
        strict.pop("train_lengths", None)  # the same samples, cut at the new budget by overlong="truncate"
    return strict


def check_resume(
    state_dict: Mapping[str, Any], current: Mapping[str, Any], settings: Mapping[str, Any] | None = None
) -> Restore:
    """Refuse a checkpoint planned for other data, or (mid-epoch) another layout or other settings.

    A checkpoint written at an epoch boundary (its loader at microbatch 0 of the next epoch) continues on another
    world size, ``accumulate_grad_batches`` or ``max_tokens`` (:data:`ELASTIC`): the next epoch is planned for the
    new layout, with the same seed and epoch number. A smaller ``max_tokens`` may cut over-long samples differently
    (``overlong="truncate"``): the training lengths may then differ, the number of training samples may not.

    Args:
        state_dict: the checkpoint's DataModule state (layout facts and, optionally, the plan settings and the
            loader state).
        current: :func:`layout_state` of the DataModule now.
        settings: :func:`plan_settings` of the DataModule now (``None``: not checked).

    Returns:
        The loader state, its resume point and the layout changes (:class:`Restore`).

    Raises:
        ValueError: the data, the mode or the model-parallel sizes differ from now; or a layout setting differs
            and the checkpoint is not at an epoch boundary (or holds no loader position); or a plan setting differs
            and the checkpoint is mid-epoch. Every difference is named with both values.
    """
    saved = dict(state_dict)
    loader_state = saved.pop(LOADER_STATE, None)
    saved_settings = saved.pop(PLAN_STATE, None)
    if _differences(_strict_facts(saved, current), current):
        raise ValueError(
            f"cannot resume: the checkpoint was planned for other data or another layout "
            f"({_differences(saved, current)}); resume with the same dataset, mode, context_parallel_size and "
            "tensor_parallel_size (world size, accumulate_grad_batches and max_tokens may change at an epoch boundary)"
        )
    point = None
    if loader_state:
        sampler = sampler_state_of(loader_state)
        point = int(sampler["epoch"]), int(sampler["position"])
    mid_epoch = point is not None and point[1] > 0
    changes = _differences({k: saved[k] for k in ELASTIC if k in saved}, current)
    if changes and (point is None or mid_epoch):
        where = "without a training loader position" if point is None else f"mid-epoch ({_point(point)})"
        raise ValueError(
            f"cannot resume {where} on another layout ({changes}): only a checkpoint written at an epoch boundary "
            "continues on another world size, accumulate_grad_batches or max_tokens (ModelCheckpoint at the end of "
            "an epoch, or last.ckpt after one); the next epoch is then planned for the new layout. Resume this one "
            "with the checkpoint's values"
        )
    if (
        mid_epoch
        and saved_settings is not None
        and settings is not None
        and (detail := _differences(saved_settings, settings))
    ):
        raise ValueError(
            f"cannot resume mid-epoch ({_point(point)}) with other plan settings "
            f"({detail}): the rest of the epoch would follow another plan, training some samples twice and "
            "others never. Resume with the checkpoint's settings, or from an end-of-epoch checkpoint"
        )
    if changes:
        log.info("Resuming at epoch %d on another layout (%s): the epoch is planned for it.", point[0], changes)
    return Restore(loader_state, point, changes)
