"""Deprecated alias of the old path: what a batch sampler hands the collator moved to :mod:`lit_seqpack.batch`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "Microbatch": "lit_seqpack.batch",
    "MicrobatchMeta": "lit_seqpack.batch",
    "PlannedDataset": "lit_seqpack.batch",
    "SourceIndices": "lit_seqpack.batch",
    "source_index": "lit_seqpack.data.splits",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())
