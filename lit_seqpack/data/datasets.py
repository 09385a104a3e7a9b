"""Deprecated alias of the old path: the index of every dataset moved to :mod:`lit_seqpack.data`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports
from lit_seqpack.data import _EXPORTS

# the names this old index re-exported; each now lives where ``lit_seqpack.data`` exports it from
_NAMES = (
    "cache_path",
    "cached_lengths",
    "cached_lengths_and_loss_tokens",
    "cached_loss_tokens",
    "compute_lengths",
    "compute_lengths_and_loss_tokens",
    "compute_loss_tokens",
    "dataset_fingerprint",
    "sample_loss_tokens",
    "OVERLONG_POLICIES",
    "DroppedDataset",
    "OverlongReport",
    "TruncatedDataset",
    "apply_overlong_policy",
    "TOKENIZED_FORMATS",
    "TokenizedDataset",
    "load_tokenized",
    "LENGTH_DISTRIBUTIONS",
    "SYNTHETIC_TASKS",
    "SyntheticInstructionDataset",
    "SyntheticTaskConfig",
    "TextDataset",
)
_MOVED = {name: _EXPORTS[name] for name in _NAMES}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())
