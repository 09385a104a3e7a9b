"""Deprecated alias of the old path: the synthetic source moved to :mod:`lit_seqpack.data.sources.synthetic`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "BOS_ID": "lit_seqpack.data.sources.synthetic",
    "EOS_ID": "lit_seqpack.data.sources.synthetic",
    "SEP_ID": "lit_seqpack.data.sources.synthetic",
    "PAD_ID": "lit_seqpack.data.sources.synthetic",
    "FIRST_PAYLOAD_ID": "lit_seqpack.data.sources.synthetic",
    "SYNTHETIC_TASKS": "lit_seqpack.data.sources.synthetic",
    "TASK_TOKEN_IDS": "lit_seqpack.data.sources.synthetic",
    "LENGTH_DISTRIBUTIONS": "lit_seqpack.data.sources.synthetic",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources.synthetic",
    "SyntheticTaskConfig": "lit_seqpack.data.sources.synthetic",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())
