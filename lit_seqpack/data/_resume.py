"""What a DataModule checkpoint records, and the check that a resume plans the same batches.

A checkpoint holds the facts the plan depends on (the data, the distributed layout, the mode and budget) and the
training loader's state. Resuming with any of those facts changed would replay a different plan from the middle,
so it is refused with a message naming every difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from lit_seqpack.data.splits import Split

__all__ = ["LOADER_STATE", "check_resume", "digest", "layout_state"]

LOADER_STATE = "train_loader"


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


def check_resume(state_dict: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any] | None:
    """Refuse a checkpoint planned for other data or another layout; return its training loader state.

    Args:
        state_dict: the checkpoint's DataModule state (layout facts and, optionally, the loader state).
        current: :func:`layout_state` of the DataModule now.

    Raises:
        ValueError: a fact of the checkpoint differs from now; every difference is named.
    """
    saved = dict(state_dict)
    loader_state = saved.pop(LOADER_STATE, None)
    changed = {k: (v, current.get(k)) for k, v in saved.items() if current.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"cannot resume: the checkpoint was planned for other data or another layout ({detail}); "
            "resume with the same dataset, world size, accumulate_grad_batches, mode and max_tokens"
        )
    return loader_state
