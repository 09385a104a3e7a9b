"""The label convention shared by the data and model layers (Hugging Face's): ``-100`` is ignored, and a
position's logits predict the next position's label."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "shift_labels"]

IGNORE_INDEX = -100
"""The label of a position that carries no loss (a prompt token, a document's first token, padding)."""


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the logits: ``out[..., t] = labels[..., t + 1]``, the last position ignored.

    Shifting the labels (a copy of ``[B, T]`` integers) rather than slicing the logits keeps the ``[B, T, V]``
    logits contiguous, so they flatten without a copy.

    Example:
        >>> shift_labels(torch.tensor([[-100, 5, 6]])).tolist()
        [[5, 6, -100]]
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
