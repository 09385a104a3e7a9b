"""What a DataModule checkpoint records, and the checks that a resume trains exactly the remaining batches.

A checkpoint holds the facts the plan depends on (the data, the distributed layout, the mode and budget), the
plan settings (seed, shuffle, algorithm, window, ...) and the training loader's state. Resuming with a fact
changed would replay a different plan from the middle, so it is refused at restore time with a message naming
every difference; changed plan settings are refused mid-epoch only (a new epoch is planned afresh anyway).

:func:`~lit_seqpack.data._trainer.check_start` is the second line: when the training loop starts drawing batches,
the sampler's start must be the Trainer's own batch counter (which decides when the optimizer steps) and an
optimizer-step boundary.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from lit_seqpack.data.indexed._loader import sampler_state_of
from lit_seqpack.data.indexed.splits import Split
from lit_seqpack.planning.plan import PlanConfig

__all__ = [
    "LOADER_STATE",
    "PLAN_SETTINGS",
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
