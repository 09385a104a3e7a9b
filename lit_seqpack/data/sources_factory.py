"""Deprecated alias of the old path: the source factory moved to :mod:`lit_seqpack.data.sources`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "SOURCES": "lit_seqpack.data.sources",
    "build_dataset": "lit_seqpack.data.sources",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())
