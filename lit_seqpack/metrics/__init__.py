"""Metrics users can trust: how much compute went to real tokens, over all ranks.

All four are :class:`torchmetrics.Metric` subclasses that update straight from a batch in the contract
(``metric.update(batch)``, reading only its Python scalars, so no device sync) and reduce correctly over
ranks: token counts are summed, elapsed time takes the slowest rank, per-step loads are gathered.
The formulas live in :mod:`lit_seqpack.metrics.functional` as pure functions.
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PaddingRatio": "lit_seqpack.metrics.packing",
    "TokensPerSecond": "lit_seqpack.metrics.packing",
    "PackingEfficiency": "lit_seqpack.metrics.packing",
    "RankImbalance": "lit_seqpack.metrics.packing",
    "training_flops": "lit_seqpack.metrics.flops",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
