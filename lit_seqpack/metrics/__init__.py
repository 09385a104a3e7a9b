"""Metrics users can trust: how much compute went to real tokens, over all ranks.

All four are :class:`torchmetrics.Metric` subclasses that update straight from a batch in the contract
(``metric.update(batch)``, reading only its Python scalars, so no device sync) and reduce correctly over
ranks: token counts are summed, elapsed time takes the slowest rank, per-step loads are gathered.
The formulas live in :mod:`lit_seqpack.metrics.functional` as pure functions.
"""

from __future__ import annotations

from lit_seqpack.metrics.counts import BatchCounts, batch_counts
from lit_seqpack.metrics.imbalance import RankImbalance
from lit_seqpack.metrics.packing import PackingEfficiency
from lit_seqpack.metrics.padding import PaddingRatio
from lit_seqpack.metrics.throughput import TokensPerSecond
from lit_seqpack.metrics.tracker import PackingTracker, RunTotals

__all__ = [
    "BatchCounts",
    "PackingEfficiency",
    "PackingTracker",
    "PaddingRatio",
    "RankImbalance",
    "RunTotals",
    "TokensPerSecond",
    "batch_counts",
]
