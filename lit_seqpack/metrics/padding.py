"""Share of the computed tokens that were padding, comparable across packed, dynamic and padded batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_seqpack.metrics.counts import BatchCounts, batch_counts
from lit_seqpack.metrics.functional import padding_ratio

__all__ = ["PaddingRatio"]


class PaddingRatio(Metric):
    """Padded tokens / computed tokens, summed over batches and ranks.

    A packed row counts its padding tail, a ``[B, L]`` batch its ``B * L - real`` pad positions and an
    empty dummy batch all its tokens, so the ratio of a packed, a dynamic and a padded run compare
    directly: it is the share of the model's token compute that went to nothing.

    ``update(batch)`` takes a batch in the contract (or :class:`~lit_seqpack.metrics.BatchCounts`) and reads
    only its Python scalars: no device sync. ``compute()`` returns a scalar tensor (0.0 before any token).

    Example:
        >>> metric = PaddingRatio()
        >>> metric.update({"num_real_tokens": 14, "num_padding_tokens": 2})
        >>> metric.update({"num_real_tokens": 0, "num_padding_tokens": 8, "is_empty": True})
        >>> round(float(metric.compute()), 4)
        0.4167
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    real_tokens: Tensor
    padding_tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("real_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("padding_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, batch: Mapping[str, Any] | BatchCounts) -> None:
        """Add one microbatch.

        Args:
            batch: a batch in the contract, or its counts.
        """
        counts = batch_counts(batch)
        self.real_tokens += counts.real_tokens
        self.padding_tokens += counts.padding_tokens

    def compute(self) -> Tensor:
        """Padding tokens / (real + padding tokens)."""
        padding = int(self.padding_tokens)
        value = padding_ratio(padding, padding + int(self.real_tokens))
        return torch.tensor(value, device=self.device)
