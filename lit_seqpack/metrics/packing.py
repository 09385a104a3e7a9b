"""NeMo-RL's packing statistics, measured on the microbatches actually trained.

Share of the computed tokens that were padding, comparable across packed, dynamic and padded batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_seqpack.metrics.counts import BatchCounts, batch_counts
from lit_seqpack.metrics.functional import packing_summary, padding_ratio

__all__ = ["PackingEfficiency", "PaddingRatio"]


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


class PackingEfficiency(Metric):
    """Bin utilisation, waste ratio, bin balance and packing efficiency of the trained microbatches.

    Each microbatch is a bin holding its real tokens, of capacity the plan's ``max_tokens`` (or its
    computed tokens when the batch carries no budget, as in the padded baseline). The formulas are
    NeMo-RL's (see :func:`~lit_seqpack.metrics.functional.packing_summary`). Measured on what was trained
    rather than on the plan, so empty lock-step dummies (bins holding nothing) and tokens lost to
    over-long truncation lower the numbers.

    The fills are kept as exact integer moments (count, sum, sum of squares; ``dist_reduce_fx="sum"``)
    rather than as a list of every fill, so the state stays constant-size over a long run and syncing
    it is cheap; the balance computed from them equals ``stats.bin_balance`` on the fills.

    ``update(batch)`` reads only the batch's Python scalars (no device sync). ``compute()`` returns a
    dict of scalar tensors: ``packing_efficiency``, ``bin_utilization``, ``waste_ratio``, ``bin_balance``
    (``higher_is_better`` refers to ``packing_efficiency``; ``waste_ratio`` is ``1 - bin_utilization``).

    Example:
        >>> metric = PackingEfficiency()
        >>> for real, pad in [(14, 2), (10, 6), (0, 8), (16, 0)]:
        ...     metric.update({"num_real_tokens": real, "num_padding_tokens": pad, "max_tokens": 16})
        >>> {k: round(float(v), 4) for k, v in metric.compute().items()}
        {'packing_efficiency': 0.75, 'bin_utilization': 0.625, 'waste_ratio': 0.375, 'bin_balance': 0.3836}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    num_bins: Tensor
    fill_sum: Tensor
    fill_sq_sum: Tensor
    capacity_sum: Tensor
    max_capacity: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("num_bins", "fill_sum", "fill_sq_sum", "capacity_sum"):
            self.add_state(name, default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("max_capacity", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="max")

    def update(self, batch: Mapping[str, Any] | BatchCounts) -> None:
        """Add one trained microbatch as a bin.

        Args:
            batch: a batch in the contract, or its counts.
        """
        counts = batch_counts(batch)
        self.num_bins += 1
        self.fill_sum += counts.real_tokens
        self.fill_sq_sum += counts.real_tokens * counts.real_tokens
        self.capacity_sum += counts.capacity
        self.max_capacity.clamp_(min=counts.capacity)

    def compute(self) -> dict[str, Tensor]:
        """The four statistics as scalar tensors (a bin-less metric counts as perfect, as in ``stats``)."""
        summary = packing_summary(
            num_bins=int(self.num_bins),
            fill_sum=int(self.fill_sum),
            fill_sq_sum=int(self.fill_sq_sum),
            capacity_sum=int(self.capacity_sum),
            max_capacity=int(self.max_capacity),
        )
        return {key: torch.tensor(value, device=self.device) for key, value in summary.items()}
