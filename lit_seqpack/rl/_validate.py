"""The checks of a :class:`~lit_seqpack.rl.Rollout`'s parts, run once over all samples at a time.

Each part (token ids, loss masks, a token field) is concatenated into one flat tensor, checked with a few vectorised
operations (the first offending sample is found from the flat position), and handed back as per-sample views of the
flat tensor: the rollout holds one buffer per part, whose bytes :meth:`~lit_seqpack.rl.Rollout.fingerprint` hashes
without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["RESERVED_KEYS", "check_name", "flat_ids", "flat_mask", "flat_token_field", "integers", "vector"]

RESERVED_KEYS = frozenset(
    {"input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen", "group_ids"}
    | {"sample_indices", "document_loss_tokens", "group_loss_tokens", "num_groups", "step", "step_documents"}
    | {"step_groups", "step_loss_tokens", "is_last_in_step", "loss_weights", "num_loss_weight", "step_loss_weight"}
    | {"num_loss_documents", "num_loss_groups", "step_loss_documents", "step_loss_groups"}
)
"""Names a declared field cannot take: the batch contract's keys and the planner's own."""


def vector(value: Any, what: str) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tensor.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.detach().cpu()


def integers(value: Any, what: str) -> torch.Tensor:
    tensor = vector(value, what)
    if tensor.numel() == 0:  # numpy types an empty list as float64
        return tensor.to(torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{what} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.int64)


def check_name(name: Any, kind: str) -> None:
    if not isinstance(name, str) or not name or name in RESERVED_KEYS:
        raise ValueError(f"{kind} name {name!r} is not allowed (reserved: {sorted(RESERVED_KEYS)})")


def _sample_at(position: int, lengths: np.ndarray) -> int:
    """The sample holding flat position ``position``."""
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


def flat_ids(values: Sequence[Any]) -> tuple[torch.Tensor, np.ndarray]:
    """The token ids of every sample as one flat ``int64`` tensor, and each sample's length."""
    ids = [integers(x, f"sample {i}: input_ids") for i, x in enumerate(values)]
    lengths = np.fromiter((x.numel() for x in ids), dtype=np.int64, count=len(ids))
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"sample {int(empty[0])}: input_ids is empty (a sample needs at least one token)")
    flat = torch.cat(ids)
    if int(flat.min()) < 0:
        first = int(torch.nonzero(flat < 0)[0])
        raise ValueError(f"sample {_sample_at(first, lengths)}: input_ids holds a negative id")
    return flat, lengths


def flat_mask(values: Sequence[Any] | None, lengths: np.ndarray) -> torch.Tensor:
    """The loss masks as one flat ``bool`` tensor (``None``: every token but each sample's first)."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if values is None:
        mask = torch.ones(int(lengths.sum()), dtype=torch.bool)
        mask[torch.from_numpy(starts)] = False
        return mask
    if len(values) != lengths.size:
        raise ValueError(f"loss_mask has {len(values)} entries for {lengths.size} samples")
    masks = []
    for i, raw in enumerate(values):
        mask = vector(raw, f"sample {i}: loss_mask")
        if mask.numel() != lengths[i]:
            raise ValueError(f"sample {i}: loss_mask has {mask.numel()} entries but input_ids has {lengths[i]}")
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(f"sample {i}: loss_mask must hold only 0 and 1 (integers or booleans)")
        masks.append(mask)
    flat = torch.cat(masks)
    if flat.dtype != torch.bool:
        bad = torch.nonzero((flat != 0) & (flat != 1))
        if bad.numel():
            raise ValueError(
                f"sample {_sample_at(int(bad[0]), lengths)}: loss_mask must hold only 0 and 1 (integers or booleans)"
            )
        flat = flat.bool()
    first = np.flatnonzero(flat[torch.from_numpy(starts)].numpy())
    if first.size:
        raise ValueError(f"sample {int(first[0])}: loss_mask[0] is 1, but no token predicts a sample's first token")
    return flat


def flat_token_field(name: str, values: Any, lengths: np.ndarray) -> torch.Tensor:
    """A declared per-token field as one flat tensor, checked against the samples' lengths (finite numbers)."""
    if isinstance(values, torch.Tensor) or len(values) != lengths.size:
        raise ValueError(f"token field {name!r} must be a list of {lengths.size} 1-D tensors (one per sample)")
    parts = []
    for i, raw in enumerate(values):
        part = vector(raw, f"sample {i}: token field {name!r}")
        if part.dtype == torch.bool or part.is_complex():
            raise ValueError(f"sample {i}: token field {name!r} must hold real numbers, got dtype {part.dtype}")
        if part.numel() != lengths[i]:
            raise ValueError(
                f"sample {i}: token field {name!r} has {part.numel()} entries but the sample has {lengths[i]} tokens"
            )
        parts.append(part)
    flat = torch.cat(parts)
    if flat.is_floating_point():
        bad = torch.nonzero(~torch.isfinite(flat))
        if bad.numel():
            raise ValueError(
                f"sample {_sample_at(int(bad[0]), lengths)}: token field {name!r} holds a NaN or an infinity"
            )
    return flat


def sample_field(name: str, values: Any, n: int) -> torch.Tensor:
    """A declared per-sample field: ``n`` finite real numbers."""
    tensor = vector(values, f"sample field {name!r}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"sample field {name!r} must hold real numbers, got dtype {tensor.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"sample field {name!r} holds a NaN or an infinity")
    if tensor.numel() != n:
        raise ValueError(f"sample field {name!r} has {tensor.numel()} entries for {n} samples")
    return tensor
