"""Deprecated alias of the old path: the index of every dataset moved to :mod:`lit_seqpack.data`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "cache_path": "lit_seqpack.data.lengths",
    "cached_lengths": "lit_seqpack.data.lengths",
    "cached_lengths_and_loss_tokens": "lit_seqpack.data.lengths",
    "cached_loss_tokens": "lit_seqpack.data.lengths",
    "compute_lengths": "lit_seqpack.data.lengths",
    "compute_lengths_and_loss_tokens": "lit_seqpack.data.lengths",
    "compute_loss_tokens": "lit_seqpack.data.lengths",
    "dataset_fingerprint": "lit_seqpack.data.lengths",
    "sample_loss_tokens": "lit_seqpack.data.lengths",
    "OVERLONG_POLICIES": "lit_seqpack.data.overlong",
    "DroppedDataset": "lit_seqpack.data.overlong",
    "OverlongReport": "lit_seqpack.data.overlong",
    "TruncatedDataset": "lit_seqpack.data.overlong",
    "apply_overlong_policy": "lit_seqpack.data.overlong",
    "TOKENIZED_FORMATS": "lit_seqpack.data.sources",
    "TokenizedDataset": "lit_seqpack.data.sources",
    "load_tokenized": "lit_seqpack.data.sources",
    "LENGTH_DISTRIBUTIONS": "lit_seqpack.data.sources",
    "SYNTHETIC_TASKS": "lit_seqpack.data.sources",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources",
    "SyntheticTaskConfig": "lit_seqpack.data.sources",
    "TextDataset": "lit_seqpack.data.sources",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())
